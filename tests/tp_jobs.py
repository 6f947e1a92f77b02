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
