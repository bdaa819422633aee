"""The realize stage: a student's initial weights, from scratch, from the donor's embedding PCA, or
cut whole out of the donor (the subclone transfer).
"""
