"""What went wrong in a failed process group: the failing rank, its exit code, its last log lines.

The frameworks' launchers each report the first failure in their own words; this module
reads those words and the per-rank log files they write under the attempt directory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

# torch.distributed.run, "Root Cause (first observed failure)" block.
_TORCH_ROOT = re.compile(
    r"Root Cause.*?rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\).*?exitcode\s*:\s*(-?\d+)", re.S
)
# every failure of that report ("Failures:" and the root cause), in order
_TORCH_FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\).*?exitcode\s*:\s*(-?\d+)", re.S)
# paddle.distributed.launch: "Container rank 1 status failed cmd [...] code -9 log ..."
_PADDLE_FAILED = re.compile(r"Container rank (\d+) status failed .*? code (-?\d+)")
# What gloo says in a rank whose peer vanished: that rank is a casualty, not the cause.
_PEER_LOST = re.compile(r"Connection (reset|closed) by peer|gloo::TimeoutException|TIMEOUT self_rank = \d+ pair_rank")


@dataclass(frozen=True)
class RankFailure:
    """The first rank that failed in one attempt."""

    rank: int | None
    local_rank: int | None
    exit_code: int | None
    log_files: list[Path] = field(default_factory=list)
    last_lines: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """One paragraph naming the rank, its exit code and its last log lines."""
        who = f"rank {self.rank}" if self.rank is not None else "a rank"
        code = f"exit code {self.exit_code}" if self.exit_code is not None else "unknown exit code"
        if self.exit_code is not None and self.exit_code < 0:
            code += f" (killed by signal {-self.exit_code})"
        logs = ", ".join(str(p) for p in self.log_files) or "no log file found"
        tail = "\n".join(f"    {line}" for line in self.last_lines) or "    (empty)"
        return f"{who} failed with {code}; logs: {logs}\n  last log lines:\n{tail}"


def parse_launcher_output(framework: str, text: str) -> tuple[int | None, int | None, int | None]:
    """(global rank, local rank, exit code) of the first failure the launcher reported, or Nones."""
    if framework == "torch":
        match = _TORCH_ROOT.search(text)
        if match:
            return int(match.group(1)), int(match.group(2)), int(match.group(3))
    else:
        match = _PADDLE_FAILED.search(text)
        if match:
            return None, int(match.group(1)), int(match.group(2))
    return None, None, None


def rank_log_files(framework: str, attempt_dir: Path, local_rank: int) -> list[Path]:
    """The log files the framework's launcher wrote for ``local_rank`` in this attempt."""
    if framework == "torch":
        # torch.distributed.run: <log_dir>/<run_id>_<random>/attempt_0/<local_rank>/{stdout,stderr}.log
        found = sorted(attempt_dir.glob(f"*/attempt_*/{local_rank}/std*.log"))
    else:
        found = sorted(attempt_dir.glob(f"workerlog.{local_rank}"))
    return [p for p in found if p.is_file()]


def tail_lines(paths: list[Path], max_lines: int) -> list[str]:
    """The last ``max_lines`` non-empty lines of each file, in file order."""
    lines: list[str] = []
    for path in paths:
        text = path.read_text(errors="replace")
        kept = [line for line in text.splitlines() if line.strip()][-max_lines:]
        if len(paths) > 1 and kept:
            lines.append(f"-- {path.name} --")
        lines.extend(kept)
    return lines


def diagnose(
    framework: str, launcher_output: str, attempt_dir: Path, node_rank: int, nproc_per_node: int, max_lines: int = 20
) -> RankFailure:
    """Combine the launcher's report with the failing rank's log files."""
    rank, local_rank, exit_code = parse_launcher_output(framework, launcher_output)
    if framework == "torch" and local_rank is not None and _lost_peer("torch", attempt_dir, local_rank):
        # torchrun's "first observed failure" can be a rank that only lost its peer, when it exited
        # before the agent saw the peer's death: a rank the same report lists as killed by a signal
        # (not the agent's own SIGTERM to the survivors) is the cause
        killed = [(int(r), int(lr), int(c)) for r, lr, c in _TORCH_FAILURE.findall(launcher_output)
                  if int(c) < 0 and int(c) != -15]
        if killed:
            rank, local_rank, exit_code = killed[0]
        else:
            cause = _root_cause_rank("torch", attempt_dir, local_rank)
            if cause != local_rank:
                rank, local_rank, exit_code = None, cause, None
    if framework == "paddle" and local_rank is not None:
        cause = _root_cause_rank("paddle", attempt_dir, local_rank)
        if cause != local_rank:
            local_rank, exit_code = cause, None
    if rank is None and local_rank is not None:
        rank = node_rank * nproc_per_node + local_rank
    files = rank_log_files(framework, attempt_dir, local_rank) if local_rank is not None else []
    return RankFailure(rank, local_rank, exit_code, files, tail_lines(files, max_lines))


def _lost_peer(framework: str, attempt_dir: Path, local_rank: int) -> bool:
    return any(_PEER_LOST.search(line) for line in tail_lines(rank_log_files(framework, attempt_dir, local_rank), 50))


def _local_ranks(framework: str, attempt_dir: Path) -> list[int]:
    if framework == "torch":
        names = {p.name for p in attempt_dir.glob("*/attempt_*/*") if p.is_dir()}
    else:
        names = {p.name.split(".")[-1] for p in attempt_dir.glob("workerlog.*")}
    return sorted(int(n) for n in names if n.isdigit())


def _root_cause_rank(framework: str, attempt_dir: Path, reported: int) -> int:
    """The launchers name the first failed rank they see; when that rank only lost its peer, and
    exactly one other rank's log shows no such loss, that rank is the cause (its exit code is
    then unknown). Otherwise the reported rank stands."""
    if not _lost_peer(framework, attempt_dir, reported):
        return reported
    candidates = [r for r in _local_ranks(framework, attempt_dir)
                  if r != reported and not _lost_peer(framework, attempt_dir, r)]
    return candidates[0] if len(candidates) == 1 else reported
