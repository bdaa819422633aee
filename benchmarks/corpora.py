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

Each file's size and document count are printed; `benchmarks/donor_gap.py` takes them as `name=path`.
"""

from __future__ import annotations

import gzip
import shutil
import subprocess
import sys
from pathlib import Path

PACKAGES = ("fortunes", "fortunes-min", "dict-foldoc", "git-doc", "perl-doc")


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


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python benchmarks/corpora.py OUT_DIR")
    out = Path(sys.argv[1]).resolve()
    root = unpack(out)
    counts = {
        "fortunes.txt": fortunes(root, out),
        "foldoc.txt": foldoc(root, out),
        "git-doc": folder(sorted((root / "usr/share/doc/git-doc").glob("*.txt")), out / "git-doc"),
        "perl-doc": folder(sorted(root.glob("usr/share/perl/*/pod/*.pod")), out / "perl-doc"),
    }
    for name, n in counts.items():
        path = out / name
        size = sum(f.stat().st_size for f in path.glob("*")) if path.is_dir() else path.stat().st_size
        print(f"{name}: {n} documents, {size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
