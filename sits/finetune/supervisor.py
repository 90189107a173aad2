"""Fine-tuning attempts forked from a warm process: the gradient-aware cold start.

The supervisor loads what every attempt of a job needs before its first step (``Prepared``: torch
imported, the base weights mapped, the dataset tokenized) once, and forks each attempt from it. An
attempt that dies (a crash, a kill, a pre-emption of the worker) is forked again and resumes from the
job's last snapshot (adapter, AdamW's moments and step, data position, RNG), so the restart pays
neither the interpreter, nor the load, nor the steps since the snapshot's predecessor, and its loss
curve continues the one it had. The supervisor runs torch on one thread only (a dtype conversion
at load): an OpenMP thread team started before a fork is not there in the child, which would hang in
its first parallel region; each attempt starts its own. So the supervisor must be a process that has
not run torch in parallel before (``sits finetune`` is; a test or benchmark starts one).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from pathlib import Path

import torch

from sits.engine.errors import SitsError
from sits.finetune.spec import FinetuneSpec
from sits.finetune.trainer import FinetuneJob, Prepared

log = logging.getLogger("sits.finetune")
NO_RESTART = 2                     # an attempt's exit status: it failed in a way a restart would repeat


def prepare(spec: FinetuneSpec) -> Prepared:
    """Load on one thread (nothing parallel before a fork) and on the CPU (a CUDA context does not
    survive a fork: an attempt moves the model to its device itself); attempts use every core again."""
    torch.set_num_threads(1)
    prepared = Prepared.load(spec, device=torch.device("cpu"))
    # what an attempt's first step would otherwise import lazily (the optimizer pulls in torch's
    # compiler stack on first construction: most of a second), paid here once; no parallel op runs
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    return prepared


threads = torch.get_num_threads()          # what attempts run with (the supervisor itself runs on one)


def fork_attempt(spec: FinetuneSpec, folder: str | Path, prepared: Prepared, *, stop_after: int | None = None,
                 progress: bool = False, exit_after: int | None = None) -> int:
    """Run one attempt of the job in a forked child; its exit status (0: it ran to its end).
    ``exit_after``: the child dies after that many steps without finishing (fault injection)."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    global _attempt
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})    # no SIGTERM between the fork and _attempt
    pid = os.fork()
    if pid == 0:                       # the child: never returns into the caller's stack
        code = 1
        try:
            _die_with_parent()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
            torch.set_num_threads(threads)
            job = FinetuneJob(spec, folder, prepared=prepared)
            job.run(stop_after=exit_after if exit_after is not None else stop_after, progress=progress)
            code = 3 if exit_after is not None else 0
        except SitsError:              # the spec, the data or the snapshot: another attempt would fail alike
            traceback.print_exc()
            code = NO_RESTART
        except BaseException:          # noqa: BLE001 - reported, then the supervisor decides
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _attempt = pid
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    Path(folder, "attempt.pid").write_text(str(pid))
    try:
        _, status = os.waitpid(pid, 0)
    finally:
        _attempt = None
    return os.waitstatus_to_exitcode(status)


_attempt: int | None = None          # the attempt running now (killed with the supervisor)


def _die_with_parent() -> None:
    """Linux: the kernel kills this process if its parent dies, however it dies (and if the parent is
    gone already, this process goes now)."""
    parent = os.getppid()
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)      # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os._exit(1)


def _on_term(signum, frame) -> None:
    if _attempt is not None:
        try:
            os.kill(_attempt, 9)
        except ProcessLookupError:
            pass
    os._exit(128 + signum)


def run_supervised(spec: FinetuneSpec, folder: str | Path, *, max_restarts: int = 3, progress: bool = False,
                   exit_first_after: int | None = None) -> int:
    """Run the job to its end, restarting a dead attempt from its snapshot up to ``max_restarts``
    times; 0 when it is done, ``NO_RESTART`` when it failed in a way a restart would repeat.
    ``exit_first_after``: the first attempt dies after that many steps."""
    signal.signal(signal.SIGTERM, _on_term)       # a cancelled job: its attempt goes with it
    try:
        prepared = prepare(spec)
    except SitsError as e:                        # the model or the dataset: no attempt could run
        FinetuneJob(spec, folder).record_failure(e)
        return NO_RESTART
    restarts = 0
    while True:
        code = fork_attempt(spec, folder, prepared, progress=progress,
                            exit_after=exit_first_after if restarts == 0 else None)
        if code in (0, NO_RESTART):
            return code
        if restarts >= max_restarts:
            log.error("fine-tuning %s: attempt died (exit %s); no restarts left", spec.name, code)
            return 1
        restarts += 1
        log.warning("fine-tuning %s: attempt died (exit %s); restarting from its snapshot (%d/%d)", spec.name,
                    code, restarts, max_restarts)


def main(argv: list[str] | None = None) -> int:
    """``python -m sits.finetune.supervisor SPEC.json FOLDER [--exit-first-after N]``: a supervisor in a
    process of its own (how tests and benchmarks start one from a process that has run torch)."""
    import argparse
    import json
    ap = argparse.ArgumentParser()
    ap.add_argument("spec")
    ap.add_argument("folder")
    ap.add_argument("--exit-first-after", type=int, default=None)
    ap.add_argument("--max-restarts", type=int, default=3)
    args = ap.parse_args(argv)
    _die_with_parent()                            # a gateway that dies takes its jobs with it
    spec = FinetuneSpec.model_validate(json.loads(Path(args.spec).read_text()))
    return run_supervised(spec, args.folder, max_restarts=args.max_restarts, exit_first_after=args.exit_first_after)


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["run_supervised", "fork_attempt", "prepare"]
