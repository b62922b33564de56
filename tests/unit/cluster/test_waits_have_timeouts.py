"""Every wait on another process has a timeout (docs/cluster.md, "Timeouts"): a scan of src/ that
fails CI when a new one comes without.

* ``ray.get`` / ``ray.wait`` outside ``cluster/remote.py`` (whose ``gather`` is the one way to wait
  on the workers: a deadline, the first failure first) pass ``timeout=``;
* ``torch.distributed`` groups (``init_process_group``, ``new_group``) pass ``timeout=`` (the
  workers give them ``rl_config.ray_timeout_s``); Megatron's parallel-state groups pass
  ``distributed_timeout_minutes=``.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[3] / "src" / "posttrain"
# (call name, the keyword that bounds its wait)
BOUNDED = {"get": "timeout", "wait": "timeout", "init_process_group": "timeout", "new_group": "timeout",
           "initialize_model_parallel": "distributed_timeout_minutes"}
# files allowed an unbounded call, and why
EXEMPT = {"cluster/remote.py": "gather: ray.wait with the deadline, then ray.get of refs known done",
          "training/megatron/dist_convert.py": "the converter's one-process group (world_size=1): no peer to wait for"}


def _waits(tree: ast.AST):
    """(line, name, keywords) of each call of ray.get / ray.wait and of the process-group builders."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, (ast.Attribute, ast.Name)):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id
        owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else None
        if name in ("get", "wait") and owner != "ray":
            continue  # dict.get, Event.wait, ...
        if name in BOUNDED:
            yield node.lineno, f"{owner + '.' if owner else ''}{name}", {k.arg for k in node.keywords}


def unbounded_waits(root: Path = SRC) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel in EXEMPT:
            continue
        text = path.read_text()
        if not any(word in text for word in ("ray.", "process_group", "new_group", "model_parallel(")):
            continue  # nothing to look at (parsing every file costs a second)
        for line, name, keywords in _waits(ast.parse(text, str(path))):
            if BOUNDED[name.rpartition(".")[2]] not in keywords:
                found.append(f"src/posttrain/{rel}:{line}: {name}(...) without {BOUNDED[name.rpartition('.')[2]]}=")
    return found


def test_every_ray_and_process_group_wait_in_src_has_a_timeout():
    found = unbounded_waits()
    assert not found, ("waits without a timeout (use posttrain.cluster.remote.gather for Ray calls, or pass the "
                       "timeout):\n" + "\n".join(found))


def test_the_scan_finds_an_unbounded_wait(tmp_path):
    (tmp_path / "x.py").write_text("import ray\nray.get(ref)\nray.wait([r], timeout=1)\nd.get('k')\n"
                                   "dist.new_group([0])\n"
                                   "ps.initialize_model_parallel(2, distributed_timeout_minutes=1)\n")
    assert unbounded_waits(tmp_path) == ["src/posttrain/x.py:2: ray.get(...) without timeout=",
                                         "src/posttrain/x.py:5: dist.new_group(...) without timeout="]
