"""The corpora the any-corpus benchmarks use besides pydoc, built from Debian packages (`apt-get download`).

    python benchmarks/corpora.py OUT_DIR

writes, in OUT_DIR (the packages' files are unpacked under OUT_DIR/debs, nothing is installed):

- `fortunes.txt`: Debian's `fortunes` and `fortunes-min` (quotations, jokes, poems), one document per
  fortune (`%` lines become `---`, the text reader's separator); read with `data=text`.
- `foldoc.txt`: Debian's `dict-foldoc`, the Free On-line Dictionary of Computing, one document per
  entry (its dictd index's offsets into the gzip'd dictionary); `data=text`.
- `git-doc/`: Debian's `git-doc`, git's manual pages and guides as AsciiDoc text (prose, command lines,
  config and shell examples), one document per file; `data=dir data.glob='*.txt'`.
- `perl-doc/`: Debian's `perl-doc`, Perl's documentation as POD (prose with Perl code), one document
  per file; `data=dir data.glob='*.pod'`.
- `manpages/`: Debian's `manpages-dev`, the Linux system calls and C library pages (sections 2 and 3,
  C synopses and example programs), each rendered to plain text by `man` at 80 columns, unjustified and
  unhyphenated; aliases (symlinks) skipped; `data=dir`.
- `django-doc/`: Django's documentation from its source release on PyPI (`pip download`), reST
  prose with Python code blocks, release notes left out; one document per file; `data=dir`.
- `pkg-readmes.jsonl`: the PyPI descriptions (README as METADATA carries it: Markdown or reST prose with
  install lines and code) of every package installed where this script runs, the project's `.venv`
  after `make setup` (those of 500 characters or more); one document per package; `data=jsonl`. The
  package versions go to `pkg-readmes.versions.txt`: another set-up day may install other versions.

Each file's size and document count are printed; `benchmarks/donor_gap.py` takes them as `name=path`.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

PACKAGES = ("fortunes", "fortunes-min", "dict-foldoc", "git-doc", "perl-doc", "manpages-dev")
DJANGO = "5.1.4"  # the source release whose docs/ is the django-doc corpus


def unpack(out: Path) -> Path:
    """The packages downloaded (no root needed) and unpacked under out/debs/x."""
    debs = out / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    subprocess.run(["apt-get", "download", *PACKAGES], cwd=debs, check=True, capture_output=True)
    root = debs / "x"
    for deb in sorted(debs.glob("*.deb")):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    return root


def fortunes(root: Path, out: Path) -> int:
    parts = []
    for f in sorted((root / "usr/share/games/fortunes").glob("*")):
        if f.is_file() and not f.suffix and not f.is_symlink():
            text = f.read_text(encoding="utf-8", errors="replace")
            parts += [p.strip("\n") for p in text.split("\n%\n") if p.strip()]
    (out / "fortunes.txt").write_text("\n---\n".join(parts) + "\n")
    return len(parts)


def foldoc(root: Path, out: Path) -> int:
    """dictd's index lines are `headword<TAB>offset<TAB>length`, both in base64 digits; aliases repeat an
    entry's offset and count once."""
    digits = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"

    def b64(s: str) -> int:
        n = 0
        for c in s:
            n = n * 64 + digits.index(c)
        return n

    base = root / "usr/share/dictd"
    data = gzip.decompress((base / "foldoc.dict.dz").read_bytes())
    spans: dict[int, int] = {}  # an entry's headword and its aliases share one offset
    for line in (base / "foldoc.index").read_text(encoding="utf-8").splitlines():
        word, offset, length = line.split("\t")
        if not word.startswith("00database"):
            spans[b64(offset)] = b64(length)
    entries = [data[o : o + n].decode("utf-8", "replace").strip("\n") for o, n in sorted(spans.items())]
    (out / "foldoc.txt").write_text("\n---\n".join(entries) + "\n")
    return len(entries)


def folder(files: list[Path], dest: Path) -> int:
    dest.mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copyfile(f, dest / f.name)
    return len(files)


def manpages(root: Path, dest: Path) -> int:
    """Each page as `man` prints it to a pipe (plain text); the same width and settings on any terminal."""
    dest.mkdir(parents=True, exist_ok=True)
    # 80 columns; no MAN_KEEP_FORMATTING, so man strips bold and underline for a pipe
    env = {**{k: v for k, v in os.environ.items() if k != "MAN_KEEP_FORMATTING"}, "MANWIDTH": "80"}
    pages = [p for s in ("man2", "man3") for p in sorted((root / "usr/share/man" / s).glob("*.gz"))]
    # an alias (symlink) names a page kept under its own name; perl-doc puts its modules in man3 as .3perl
    pages = [p for p in pages if not p.is_symlink() and not p.name.endswith("perl.gz")]
    for page in pages:
        text = subprocess.run(
            ["man", "--nj", "--nh", "-l", str(page)], env=env, check=True, capture_output=True, text=True
        ).stdout
        (dest / f"{page.name.removesuffix('.gz')}.txt").write_text(text)
    return len(pages)


def django_doc(out: Path, dest: Path) -> int:
    """docs/**/*.txt of Django's sdist, one file per document named by its path; release notes and the
    HTML theme's licence file left out."""
    src = out / "debs" / "django"
    src.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", f"django=={DJANGO}"]
    subprocess.run([*pip, "-d", str(src)], check=True, capture_output=True)
    with tarfile.open(next(src.glob("*.tar.gz"))) as tar:
        tar.extractall(src, filter="data")
    docs = next(src.glob(f"[Dd]jango-{DJANGO}/docs"))  # the sdist's top folder: Django-<version> or django-
    skip = ("releases", "_theme")
    files = [f for f in sorted(docs.rglob("*.txt")) if f.relative_to(docs).parts[0] not in skip]
    dest.mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copyfile(f, dest / "_".join(f.relative_to(docs).parts))
    return len(files)


def pkg_readmes(out: Path) -> int:
    """Each installed distribution's METADATA body (after the headers' blank line), in the order of their
    dist-info folders' paths; the names and versions beside it."""
    site = Path(sysconfig.get_paths()["purelib"])  # this interpreter's site-packages
    docs, versions = [], []
    for meta in sorted(site.glob("*.dist-info/METADATA")):
        text = meta.read_text(errors="replace")
        body = text.split("\n\n", 1)[1] if "\n\n" in text else ""
        if len(body) >= 500:
            docs.append(json.dumps({"text": body}))
            versions.append(meta.parent.name.removesuffix(".dist-info"))
    (out / "pkg-readmes.jsonl").write_text("".join(f"{d}\n" for d in docs))
    (out / "pkg-readmes.versions.txt").write_text("".join(f"{v}\n" for v in versions))
    return len(docs)


def main() -> None:
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):  # `--help` is not a folder to fill
        sys.exit("usage: python benchmarks/corpora.py OUT_DIR (the folder the corpora are written to)")
    out = Path(sys.argv[1]).resolve()
    root = unpack(out)
    counts = {
        "fortunes.txt": fortunes(root, out),
        "foldoc.txt": foldoc(root, out),
        "git-doc": folder(sorted((root / "usr/share/doc/git-doc").glob("*.txt")), out / "git-doc"),
        "perl-doc": folder(sorted(root.glob("usr/share/perl/*/pod/*.pod")), out / "perl-doc"),
        "manpages": manpages(root, out / "manpages"),
        "django-doc": django_doc(out, out / "django-doc"),
        "pkg-readmes.jsonl": pkg_readmes(out),
    }
    for name, n in counts.items():
        path = out / name
        size = sum(f.stat().st_size for f in path.glob("*")) if path.is_dir() else path.stat().st_size
        print(f"{name}: {n} documents, {size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
