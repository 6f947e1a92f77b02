"""The rules between server arguments (each argument alone is checked from its declaration in
`batonlm/config.py`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from batonlm.settings import ConfigError

if TYPE_CHECKING:
    from batonlm.config import ServerArgs


def check_relations(args: ServerArgs) -> None:
    """Raise ConfigError naming the argument whose value breaks a rule with another's."""
    if args.max_loaded_loras is not None and args.max_loaded_loras < len(args.lora_adapters):
        raise ConfigError("max_loaded_loras", f"must hold the {len(args.lora_adapters)} adapters of --lora-paths")
    if args.lora_slots and args.enable_dp_attention:
        raise ConfigError("lora_paths", "LoRA adapters do not combine with DP attention")
    if (args.speculative_algorithm == "draft") != (args.speculative_draft_model is not None):
        raise ConfigError("speculative_draft_model", "give a draft model with --speculative-algorithm draft, "
                          "and only then")
    if args.speculative_ngram_max < args.speculative_ngram_min:
        raise ConfigError("speculative_ngram_max", f"must be at least speculative_ngram_min "
                          f"({args.speculative_ngram_min}), got {args.speculative_ngram_max!r}")
    if args.api_key is not None and args.api_key_file is not None:
        raise ConfigError("api_key_file", "give the API key or a file holding it, not both")
    if args.dp_size > 1 and args.nnodes > 1:
        raise ConfigError("dp_size", "data parallelism runs on one node (give nnodes 1, or dp_size 1)")
    if args.dp_size > 1 and args.dist_init_addr is not None:
        raise ConfigError("dist_init_addr", "is for several nodes; with --dp each replica's ranks meet at a "
                          "free local port of their own")
    if args.enable_dp_attention and args.dp_size < 2:
        raise ConfigError("enable_dp_attention", "needs at least two data-parallel replicas (--dp 2 or more)")
    if args.enable_dp_attention and args.tp_size > 1:
        raise ConfigError("enable_dp_attention", "runs one rank per replica: give --tp 1 (the MLP is split "
                          "over the replicas instead)")
    if args.enable_dp_attention and args.speculative_algorithm != "none":
        raise ConfigError("enable_dp_attention", "does not combine with speculative decoding")
    if args.node_rank >= args.nnodes:
        raise ConfigError("node_rank", f"must be in 0..{args.nnodes - 1} (nnodes {args.nnodes}), got {args.node_rank!r}")
    if args.tp_size % args.nnodes:
        raise ConfigError("nnodes", f"the tensor parallel size ({args.tp_size}) must be a multiple of the node "
                          f"count ({args.nnodes}): every node runs the same number of ranks")
    if args.nnodes > 1 and args.dist_init_addr is None:
        raise ConfigError("dist_init_addr", "give node 0's host:port (every node the same) when nnodes > 1")
    if args.dist_init_addr is not None:
        host, _, port = args.dist_init_addr.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError("dist_init_addr", f"must be host:port, got {args.dist_init_addr!r}")
