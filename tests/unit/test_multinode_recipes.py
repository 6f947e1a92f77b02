"""The multi-node recipes (docker compose, SLURM, Kubernetes LeaderWorkerSet) start nodes whose
flags `batonlm serve` accepts and that form one group: same model and tensor-parallel size, node
ranks 0..nnodes-1, every node meeting at the same address, only node 0 serving HTTP."""

import re
import shlex
import subprocess
from pathlib import Path

import yaml

from batonlm.cli import parse_serve_args

RECIPES = Path(__file__).resolve().parents[2] / "docker" / "multinode"


def _check_group(nodes: list[list[str]]) -> None:
    args = [parse_serve_args(argv) for argv in nodes]
    assert sorted(a.node_rank for a in args) == list(range(args[0].nnodes)) == list(range(len(nodes)))
    assert len({(a.model, a.tp_size, a.nnodes, a.dist_init_addr, a.dtype) for a in args}) == 1
    assert all(a.dist_init_addr for a in args)
    assert args[0].tp_size % args[0].nnodes == 0
    leader = next(a for a in args if a.node_rank == 0)
    assert leader.host == "0.0.0.0"


def test_docker_compose_two_nodes():
    doc = yaml.safe_load((RECIPES / "compose.two-nodes.yaml").read_text())
    services = doc["services"]
    _check_group([shlex.split(s["command"]) for s in services.values()])
    assert services["node0"]["ports"] == ["30000:30000"]
    assert services["node1"]["healthcheck"] == {"disable": True}  # the image's check is HTTP
    # Each "node" gets GPUs of its own (a `count` would give both services the same ones).
    gpus = [s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for s in services.values()]
    assert len(set(sum(gpus, []))) == sum(len(g) for g in gpus) == 4


def test_kubernetes_leader_worker_set():
    docs = list(yaml.safe_load_all((RECIPES / "leaderworkerset.yaml").read_text()))
    lws = docs[0]["spec"]["leaderWorkerTemplate"]
    env = {"$(LWS_LEADER_ADDRESS)": "10.0.0.7", "$(LWS_WORKER_INDEX)": "1"}

    def argv(template) -> list[str]:
        out = []
        for a in template["spec"]["containers"][0]["args"]:
            for k, v in env.items():
                a = a.replace(k, v)
            out.append(a)
        return out

    _check_group([argv(lws["leaderTemplate"]), argv(lws["workerTemplate"])])
    assert lws["size"] == 2 and lws["restartPolicy"] == "RecreateGroupOnPodRestart"


def test_slurm_batch_script():
    script = (RECIPES / "slurm.sbatch").read_text()
    subprocess.run(["bash", "-n", str(RECIPES / "slurm.sbatch")], check=True)
    nodes = int(re.search(r"#SBATCH --nodes=(\d+)", script).group(1))
    command = re.search(r"exec batonlm serve (.*?)\n\"", script, re.S).group(1).replace("\\\n", " ")
    nodes_argv = []
    for node in range(nodes):
        line = (command.replace("\\$SLURM_NNODES", str(nodes)).replace("\\$SLURM_NODEID", str(node))
                .replace("$HEAD", "gpu-001").replace("$PORT", "29500").replace("'$MODEL'", "meta-llama/Llama-3.1-70B"))
        nodes_argv.append(shlex.split(line))
    _check_group(nodes_argv)
