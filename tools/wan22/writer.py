"""Writing the assembled directory: a list of steps carried out in a temporary directory
beside the target, then renamed into place. A failure (or Ctrl-C) leaves no output and
an existing output untouched; with --overwrite the old output is swapped out only after
the new one is complete."""
from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from .checkpoint import AssemblyError


@dataclass(frozen=True)
class Step:
    dest: str                  # path inside the output, "/"-separated
    kind: str                  # "copy" (file or folder) | "link" (relative symlink) | "write"
    source: Path | None = None
    data: bytes | None = None  # for "write"
    note: str = ""             # for the summary

    def copy_bytes(self) -> int:
        if self.kind != "copy":
            return 0
        if self.source.is_dir():
            return sum(p.stat().st_size for p in self.source.rglob("*") if p.is_file())
        return self.source.stat().st_size

    def link_text(self, final_root: Path) -> str:
        """The relative link target, computed from where the link will finally live, so it stays
        valid when the output and its sources move together. Resolving the source's folder (not
        the source itself) keeps names of links inside a Hugging Face snapshot readable."""
        target = Path(os.path.realpath(self.source.parent)) / self.source.name
        link_dir = (final_root / self.dest).parent
        return os.path.relpath(target, start=link_dir)

    def apply(self, root: Path, final_root: Path) -> None:
        dest = root / self.dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        if self.kind == "write":
            dest.write_bytes(self.data)
        elif self.kind == "link":
            os.symlink(self.link_text(final_root), dest)
        elif self.source.is_dir():  # copies follow symlinks: the output owns real files
            try:
                shutil.copytree(self.source, dest, copy_function=shutil.copyfile)
            except shutil.Error as exc:  # a list of (src, dst, why): name the first source
                src, _dst, why = exc.args[0][0]
                raise AssemblyError(f"copying {src} failed: {why}") from None
        else:
            shutil.copyfile(self.source, dest)


def _inside(path: Path, root: Path) -> bool:
    path, root = Path(os.path.realpath(path)), Path(os.path.realpath(root))
    return path == root or root in path.parents


def check_output(out: Path, overwrite: bool, sources: list[Path]) -> None:
    """Refuse an output the run may not (or must not) replace, before any work is done."""
    if not (out.exists() or out.is_symlink()):
        return
    if not overwrite:
        raise AssemblyError(f"--output-dir {out}: already exists (pass --overwrite to replace it)")
    if out.is_symlink() or not out.is_dir():
        raise AssemblyError(f"--output-dir {out}: exists and is not a directory; refusing to replace it")
    if any(out.iterdir()) and not (out / "model_index.json").is_file():
        raise AssemblyError(f"--output-dir {out}: not a diffusers directory (no model_index.json); "
                            f"refusing to replace it even with --overwrite")
    for source in sources:
        if _inside(source, out):
            raise AssemblyError(f"--output-dir {out}: {source} lies inside it, and --overwrite would "
                                f"replace it; choose another output directory")


def check_space(steps: list[Step], out: Path) -> None:
    needed = sum(s.copy_bytes() for s in steps)
    probe = out.parent
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed > free:
        raise AssemblyError(f"--output-dir {out}: copying needs {needed / 2**30:.2f} GiB but {probe} has "
                            f"{free / 2**30:.2f} GiB free (use --asset-mode symlink or free some space)")


def write(steps: list[Step], out: Path, overwrite: bool) -> None:
    created = _make_parents(out.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.assembling-", dir=out.parent))
    try:
        _set_default_mode(tmp)
        final_root = Path(os.path.realpath(out.parent)) / out.name
        for step in steps:
            step.apply(tmp, final_root)
        _swap_in(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for folder in reversed(created):
            try:
                folder.rmdir()
            except OSError:
                break
        raise


def _make_parents(folder: Path) -> list[Path]:
    """mkdir -p, returning the folders it created (outermost first) so a failure can undo it."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    missing.reverse()
    for m in missing:
        m.mkdir()
    return missing


def _set_default_mode(folder: Path) -> None:
    # mkdtemp makes a 0700 folder; the output should get the permissions mkdir would give it.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)


def _swap_in(tmp: Path, out: Path, overwrite: bool) -> None:
    if not (out.exists() or out.is_symlink()):
        os.rename(tmp, out)  # fails (ENOTEMPTY) if someone filled `out` meanwhile
        return
    if not overwrite:
        raise AssemblyError(f"--output-dir {out}: appeared while assembling; not replacing it")
    old = out.parent / f".{out.name}.replaced-{uuid.uuid4().hex[:8]}"
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    # The old output's links are removed, never followed: its sources are untouched.
    shutil.rmtree(old, ignore_errors=True)
