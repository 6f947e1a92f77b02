"""Jobs run in spawned processes, one per tensor-parallel rank, by the tensor-parallel tests.
Each joins a gloo group at `addr` and puts what it measured into `out` (a queue)."""

from __future__ import annotations

import traceback

import torch


def _forward_batches(runner, gen: torch.Generator):
    """A prefill of two prompts (7 and 12 tokens), then their next decode step."""
    from batonlm.model_runner.forward_batch import ForwardBatch

    lengths, slots = [7, 12], [1, 2]
    ids = torch.randint(3, runner.cfg.vocab_size, (sum(lengths),), generator=gen)
    loc = torch.arange(1, 1 + sum(lengths))
    yield ForwardBatch.build(loc, slots, [0, 0], lengths, "cpu", input_ids=ids)
    decode_ids = torch.randint(3, runner.cfg.vocab_size, (2,), generator=gen)
    yield ForwardBatch.build(torch.tensor([20, 21]), slots, lengths, [1, 1], "cpu", input_ids=decode_ids)


def forward_job(rank: int, size: int, addr: str, model: str, out) -> None:
    """Two forwards of the same batches on every rank: rank's collective counts per forward and
    its logits."""
    try:
        from batonlm.distributed.group import TPGroup
        from batonlm.model_runner.model_config import ModelConfig
        from batonlm.model_runner.model_runner import ModelRunner

        torch.set_num_threads(1)
        tp = TPGroup.init(rank, size, addr, 60.0, "cpu") if size > 1 else TPGroup.single()
        runner = ModelRunner(ModelConfig.from_hf(model), dtype=torch.float32, device="cpu", kv_capacity=64,
                             num_req_slots=4, context_length=64, attention_backend="torch", sampler="torch", tp=tp)
        counts, logits = [], []
        for batch in _forward_batches(runner, torch.Generator().manual_seed(0)):
            before = tp.counts.snapshot()
            logits.append(runner.forward(batch))
            after = tp.counts
            counts.append((after.all_reduce - before.all_reduce, after.all_gather - before.all_gather))
        out.put((rank, counts, [x.tolist() for x in logits]))
        tp.destroy()
    except Exception:
        out.put((rank, traceback.format_exc(), None))


def relay_job(rank: int, size: int, addr: str, messages: list[bytes], out) -> None:
    """Rank 0 relays `messages` with a heartbeat between each; the others report what came."""
    try:
        from batonlm.distributed.group import TPGroup
        from batonlm.distributed.relay import LaunchRelay

        tp = TPGroup.init(rank, size, addr, 60.0, "cpu")
        relay = LaunchRelay(tp)
        got = []
        for m in messages:
            if rank == 0:
                relay.send(m)
                relay.heartbeat()
            else:
                got.append(relay.recv())
                got.append(relay.recv())
        out.put((rank, got, (relay.messages, relay.heartbeats, tp.counts.broadcast)))
        tp.destroy()
    except Exception:
        out.put((rank, traceback.format_exc(), None))


def agreement_job(rank: int, size: int, addr: str, values: list[int], out) -> None:
    """check_agreement over `values[rank]`: None when the ranks agree, else the error."""
    try:
        from batonlm.distributed.divergence import TPDivergenceError, check_agreement
        from batonlm.distributed.group import TPGroup

        tp = TPGroup.init(rank, size, addr, 60.0, "cpu")
        try:
            check_agreement(tp, values[rank], "batch 7")
            out.put((rank, None, None))
        except TPDivergenceError as e:
            out.put((rank, None, str(e)))
        tp.destroy()
    except Exception:
        out.put((rank, traceback.format_exc(), None))


def run_ranks(job, size: int, *args, timeout: float = 120.0) -> dict[int, tuple]:
    """Run `job(rank, size, addr, *args, queue)` in `size` spawned processes; rank -> its report.
    A job that failed reports its traceback as a string in the report's first field."""
    import multiprocessing as mp

    from batonlm.device.spec import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    addr = f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=job, args=(r, size, addr, *args, out)) for r in range(size)]
    for p in procs:
        p.start()
    try:
        reports = {}
        for _ in range(size):
            rank, *rest = out.get(timeout=timeout)
            reports[rank] = tuple(rest)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    for rank, rep in reports.items():
        assert not isinstance(rep[0], str), f"rank {rank} failed:\n{rep[0]}"
    return reports


def dp_scheduler_job(rank: int, size: int, addr: str, model: str, dp_dir: str, schedule, overlap: bool,
                     env: dict, out) -> None:
    """One data-parallel replica with DP attention: a scheduler (and its device worker) driven by
    LocalIO; `schedule` is [(rid, prompt ids, max new tokens, arrival iteration, rank)]. Reports
    its records' tokens and its stats."""
    import os

    os.environ.update(env)
    try:
        from batonlm.config import ServerArgs
        from batonlm.ipc.messages import GenerateRequest
        from batonlm.sampling_params import SamplingParams
        from batonlm.scheduler.local_io import LocalIO
        from batonlm.scheduler.process import build_scheduler

        io = LocalIO()
        args = ServerArgs(model=model, dp_size=size, enable_dp_attention=True, chunked_prefill_size=16,
                          disable_overlap=not overlap)
        sched, _ = build_scheduler(args, io, rank, dp_dir)
        io.bind(lambda: sched.iteration)
        for rid, ids, n, at, owner in schedule:
            if owner == rank:
                io.submit(GenerateRequest(rid, ids, SamplingParams(temperature=0.0, max_new_tokens=n)), at)
        try:
            sched.event_loop_overlap() if overlap else sched.event_loop_normal()
            stats = sched.stats()
        finally:
            sched.device.close()
            sched.agreement.close()
        out.put((rank, {rid: r.token_ids for rid, r in io.records.items()},
                 (stats.dp_pairings, stats.dp_decisions_checked, sched.iteration)))
    except Exception:
        out.put((rank, traceback.format_exc(), None))


def dp_decision_job(rank: int, size: int, addr: str, decisions: list[bool], out) -> None:
    """Each rank reports it took `decisions[rank]`, then syncs: the error, if any."""
    try:
        from batonlm.scheduler.dp_sync import DPDivergenceError, DPSync

        sync = DPSync(rank, size, addr, 60.0)
        sync.exchange(None, done=False, stop=False)  # no decision yet: nothing to compare
        sync.decided(decisions[rank])
        try:
            res = sync.exchange(None, done=True, stop=False)
            out.put((rank, None, ("ok", res.exit, sync.decisions_checked)))
        except DPDivergenceError as e:
            out.put((rank, None, ("error", str(e), sync.decisions_checked)))
        sync.close()
    except Exception:
        out.put((rank, traceback.format_exc(), None))
