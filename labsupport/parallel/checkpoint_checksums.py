"""A checkpoint's files and their SHA-256 checksums, written with them and checked before
they are loaded.

``torch.distributed.checkpoint`` (DCP) checks nothing it reads. A shard damaged in place,
its size unchanged, loads without a word: in the course's tests, 4 KiB of zeros set a
thousand of Adam's first moments to 0, and one flipped bit turned a moment of -0.0054
into -1.8e36. A shard copied in from another run loads as well. (Each tensor is a
``torch.save`` zip archive whose records carry a CRC-32, but ``torch.load`` does not
check it, and another run's shard would pass it.) So :class:`ChecksummedWriter` adds a
manifest, :data:`MANIFEST`, to every checkpoint: the SHA-256 of each file, in
``sha256sum``'s format. Each rank hashes the files it wrote right after writing them (in
``async_save``'s background thread, too), the hashes travel to the coordinator with
DCP's write results, and the coordinator writes the manifest last, after ``.metadata``:
a checkpoint without one is incomplete. To load, :func:`manifest` checks ``.metadata``
before DCP reads it, and :class:`VerifyingReader` the data files, in DCP's planning
step, each loading rank a share of them: DCP stops every rank if one fails, before any
has read a byte into the caller's tensors. Both extend DCP's own ``FileSystemWriter``
and ``FileSystemReader`` (``torch/distributed/checkpoint/filesystem.py``); the files
are DCP's, and ``.metadata`` holds nothing of ours.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.futures import Future

#: The checksums of a checkpoint's files, written last (``sha256sum -c SHA256SUMS``
#: checks them from a shell, in the checkpoint's folder).
MANIFEST = "SHA256SUMS"


class CheckpointError(RuntimeError):
    """A checkpoint that must not be loaded: incomplete, damaged, or not this state's."""


def verify(path: str) -> None:
    """Check every file of the checkpoint at ``path`` against its :data:`MANIFEST`, in
    this process; raise :class:`CheckpointError` if it is incomplete or damaged."""
    digests = manifest(path)  # and .metadata checked
    _check(path, {name: digest for name, digest in digests.items() if name != ".metadata"})


def manifest(path: str) -> dict[str, str]:
    """The SHA-256 of each file of the checkpoint at ``path``, by name, from its
    :data:`MANIFEST`, once ``.metadata`` has matched its own and the manifest has been
    found to list every file that ``.metadata`` refers to."""
    written = Path(path, MANIFEST)
    if not written.is_file():
        raise CheckpointError(
            f"the checkpoint at {path} is incomplete: it has no {MANIFEST}, which is written "
            "last, once every rank has written its files (the run was stopped while saving "
            "it, or another program wrote it); resume from the previous checkpoint"
        )
    digests = {}
    for line in written.read_bytes().decode(errors="replace").splitlines():
        entry = re.fullmatch(r"([0-9a-f]{64})  ([\w.-]+)", line)
        if entry is None:
            raise _damaged(path, f"{MANIFEST} has a line that is not 'checksum  file'")
        digests[entry[2]] = entry[1]
    _check(path, {".metadata": digests.get(".metadata")})
    storage = FileSystemReader(path).read_metadata().storage_data
    unlisted = {info.relative_path for info in storage.values()} - digests.keys()
    if unlisted:
        raise _damaged(path, f"{MANIFEST} does not list {', '.join(sorted(unlisted))}")
    return digests


def _check(path, expected: dict) -> None:
    """Raise :class:`CheckpointError` if a file of ``expected`` (name: SHA-256) is missing,
    has no checksum (``None``) or has changed since it was saved."""
    wrong = []
    for name, digest in sorted(expected.items()):
        if digest is None:
            wrong.append(f"{name} has no checksum in {MANIFEST}")
        elif not Path(path, name).is_file():
            wrong.append(f"{name} is missing")
        elif _sha256(Path(path, name)) != digest:
            wrong.append(
                f"{name} has changed since it was saved: its SHA-256 is not the one in {MANIFEST}"
            )
    if wrong:
        more = f"; and {len(wrong) - 2} more" if len(wrong) > 2 else ""
        raise _damaged(path, "; ".join(wrong[:2]) + more)


def _damaged(path, what: str) -> CheckpointError:
    return CheckpointError(
        f"the checkpoint at {path} is damaged: {what}. Nothing was loaded from it: resume "
        "from the previous checkpoint"
    )


def _sha256(file) -> str:
    """The SHA-256 of ``file``, as ``sha256sum`` prints it."""
    with open(file, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@dataclasses.dataclass(frozen=True)
class _Hashed:
    """DCP's storage information of one write, and the SHA-256 of the file it went to."""

    info: object
    sha256: str


class ChecksummedWriter(FileSystemWriter):
    """DCP's file writer, which also writes the :data:`MANIFEST`, last."""

    def prepare_global_plan(self, plans):
        # on the coordinator, before any rank writes: a folder being overwritten is
        # incomplete until its new manifest is in place
        Path(self.path, MANIFEST).unlink(missing_ok=True)
        return super().prepare_global_plan(plans)

    def write_data(self, plan, planner) -> Future:
        digests, hashed = {}, []
        for result in super().write_data(plan, planner).wait():
            name = result.storage_data.relative_path
            if name not in digests:  # each file once, right after it was written
                digests[name] = _sha256(Path(self.path, name))
            hashed.append(
                dataclasses.replace(
                    result, storage_data=_Hashed(result.storage_data, digests[name])
                )
            )
        future = Future()
        future.set_result(hashed)
        return future

    def finish(self, metadata, results) -> None:
        digests = {
            r.storage_data.info.relative_path: r.storage_data.sha256 for rs in results for r in rs
        }
        plain = [
            [dataclasses.replace(r, storage_data=r.storage_data.info) for r in rs] for rs in results
        ]
        super().finish(metadata, plain)  # writes .metadata, as DCP writes it
        digests[".metadata"] = _sha256(Path(self.path, ".metadata"))
        temporary = Path(self.path, f"{MANIFEST}.tmp")
        with open(temporary, "w") as f:
            f.writelines(f"{digest}  {name}\n" for name, digest in sorted(digests.items()))
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, Path(self.path, MANIFEST))


class VerifyingReader(FileSystemReader):
    """DCP's file reader, which first checks the checkpoint's files against their
    checksums (``digests``, from :func:`manifest`) in DCP's planning step: loading rank
    ``rank`` of ``world`` checks every ``world``-th file, so that the ranks read the
    checkpoint once between them, and DCP stops every rank if one finds a file changed."""

    def __init__(self, path, digests: dict, rank: int, world: int) -> None:
        super().__init__(path)
        self.digests, self.share = digests, slice(rank, None, world)

    def prepare_local_plan(self, plan):
        files = sorted(name for name in self.digests if name != ".metadata")
        _check(self.path, {name: self.digests[name] for name in files[self.share]})
        return super().prepare_local_plan(plan)
