"""The seed's recipes planned for their own hardware: ``posttrain plan --target`` on every config of
``configs/`` that copies a MindSpeed-RL recipe, and the table of their verdicts in
``docs/parallelism.md``.

    python -m posttrain.commands.seed_plans            # print the table
    python -m posttrain.commands.seed_plans --write    # rewrite it in docs/parallelism.md and the configs' headers

The seed ran on Ascend NPUs of 64 GB: Atlas 800T A2 nodes hold 8 of them, Atlas 900 A3 SuperPoD
nodes 16 dies (the seed counts a die as a device). :data:`SEED_RECIPES` names each config, the
seed's file it copies and that hardware; :func:`plan_recipe` runs the one plan ``posttrain plan
--target`` runs and returns its verdict (accepted with the memory per device, or every refusal).
Each recipe's config header carries the same verdict (:func:`header_block`).
``tests/unit/commands/test_seed_plans.py`` pins the verdicts and fails when the table in the docs
or a header differs from what the code prints.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from posttrain.config.arch import model_arch
from posttrain.config.plan import GIB, Plan, build_plan, resolve_plan
from posttrain.config.run import load_run_config
from posttrain.config.target import Target, parse_target
from posttrain.config.validate import validate_run_config
from posttrain.errors import ConfigError
from posttrain.paths import PROJECT_ROOT

DOC_PATH = PROJECT_ROOT / "docs" / "parallelism.md"
BEGIN, END = "<!-- seed-plans: begin (python -m posttrain.commands.seed_plans --write) -->", "<!-- seed-plans: end -->"
REGENERATE = "python -m posttrain.commands.seed_plans --write"
CONFIGS = PROJECT_ROOT / "configs"
HEADER_BEGIN = "# --- posttrain plan on the seed's hardware (python -m posttrain.commands.seed_plans --write) ---"
HEADER_END = "# ---"
NPU = "npu:64GiB"  # Ascend 910B (A2) and one die of a 910C (A3): 64 GB of HBM each
A2 = "Atlas 800T A2 (8 NPUs of 64 GB per node)"
A3 = "Atlas 900 A3 SuperPoD (16 dies of 64 GB per node)"


@dataclass(frozen=True)
class SeedRecipe:
    """A config of ``configs/`` that copies a seed recipe, and the hardware the seed ran it on."""

    name: str  # configs/<name>.yaml
    seed: str  # MindSpeed-RL's configs/<seed>.yaml
    nodes: int
    devices_per_node: int
    hardware: str  # in words
    as_written: bool = True  # the seed's file, its comments left out (else rewritten: its header says how)
    target: str = NPU

    def parsed_target(self) -> Target:
        return parse_target(self.target, self.nodes, self.devices_per_node)

    @property
    def command(self) -> str:
        return (f"posttrain plan --config-name {self.name} --target {self.target} --nodes {self.nodes} "
                f"--devices-per-node {self.devices_per_node}")


SEED_RECIPES: tuple[SeedRecipe, ...] = (
    # shipped in the seed's layout (their headers say what was changed)
    SeedRecipe("r1_zero_qwen25_7b", "r1_zero_qwen25_7b", 1, 8, A2, False),
    SeedRecipe("grpo_lora_qwen25_32b", "grpo_lora_qwen25_32b_A2", 2, 8, A2, False),
    SeedRecipe("dapo_qwen25_7b_multi_turn", "dapo_qwen25_7b_A2_multi_turn", 1, 8, A2, False),
    SeedRecipe("dapo_qwen25_32b", "dapo_qwen25_32b_A3", 4, 16, A3, False),
    SeedRecipe("ppo_qwen25_32b", "ppo_qwen25_32b_A3", 2, 16, A3, False),
    SeedRecipe("dpo_qwen3_30b_a3b", "dpo_qwen3_30b_a3b_A3", 2, 8, "2 nodes x 8 devices (the seed's DPO docs)", False),
    # shipped as the seed wrote them
    SeedRecipe("grpo_qwen25_7b_A3", "grpo_qwen25_7b_A3", 1, 16, A3),
    SeedRecipe("grpo_qwen25_32b_A2", "grpo_qwen25_32b_A2", 2, 8, A2),
    SeedRecipe("grpo_qwen25_32b_A3", "grpo_qwen25_32b_A3", 1, 16, A3),
    SeedRecipe("grpo_qwen3_8b_A3", "grpo_qwen3_8b_A3", 1, 16, A3),
    SeedRecipe("grpo_qwen3_235b_a22b_A2", "grpo_qwen3_235b_a22b_A2", 16, 8, A2),
    SeedRecipe("grpo_deepseek_r1_671b_A2", "grpo_deepseek_r1_671b_A2", 32, 8, A2),
    SeedRecipe("grpo_deepseek_r1_671b_A3", "grpo_deepseek_r1_671b_A3", 16, 16, A3),
    SeedRecipe("grpo_deepseek_r1_671b_A3_eplb", "grpo_deepseek_r1_671b_A3_eplb", 16, 16, A3),
    SeedRecipe("dapo_qwen25_32b_A2_20k", "dapo_qwen25_32b_A2_20k", 8, 8, A2),
    SeedRecipe("dapo_qwen25_32b_A3_32k", "dapo_qwen25_32b_A3_32k", 4, 16, A3),
    SeedRecipe("dapo_qwen3_30b_a3b_A3", "dapo_qwen3_30b_a3b_A3", 1, 16, A3),
    SeedRecipe("dapo_qwen3_32b_A3", "dapo_qwen3_32b_A3", 1, 16, A3),
)
RECIPES = {r.name: r for r in SEED_RECIPES}


@dataclass(frozen=True)
class Verdict:
    """What ``posttrain plan --target`` says of a recipe on its hardware."""

    recipe: SeedRecipe
    reasons: tuple[str, ...]  # every refusal, one per line; empty when accepted
    plan: Plan | None  # the plan (accepted), or the plan derived without the checks (refused), None if none can be

    @property
    def accepted(self) -> bool:
        return not self.reasons

    @property
    def memory_per_device(self) -> float | None:
        """Bytes per device (the estimate's total per worker process), when the plan can be derived."""
        return self.plan.memory.total if self.plan is not None and self.plan.memory is not None else None


def plan_recipe(recipe: SeedRecipe, overrides: tuple[str, ...] = ()) -> Verdict:
    """``posttrain plan --config-name NAME --target ...`` without printing: the verdict. For a refused
    recipe the plan is still derived where the seed's rules allow it (the memory per device shown
    in the table), by the same derivation without the checks."""
    cfg = load_run_config(recipe.name, overrides=list(overrides))
    target = recipe.parsed_target()
    try:
        return Verdict(recipe, (), resolve_plan(cfg, target=target))
    except ConfigError as err:
        reasons = tuple(str(err).splitlines())
    try:
        layout = validate_run_config(cfg, device_type=target.device, num_nodes=recipe.nodes)
        plan = build_plan(cfg, layout, model_arch(cfg), device=target.device, target=target)
    except ConfigError:
        plan = None
    return Verdict(recipe, reasons, plan)


def reason_key(reason: str) -> str:
    """The key (or the check) a refusal names first, for the table: ``generate_config.offload_train_param``."""
    if reason.startswith("the plan's memory estimate"):
        return "memory per device"
    if reason.startswith(("the native rollout", "the vLLM rollout")):
        return "rollout copy larger than a device"
    head = reason.split(":")[0].split("=")[0].split(" ")[0]
    return head.rstrip(",.")


def render_table(verdicts: list[Verdict] | None = None) -> str:
    """The markdown table of the seed recipes' verdicts on their own hardware."""
    verdicts = verdicts if verdicts is not None else [plan_recipe(r) for r in SEED_RECIPES]
    lines = ["| config | the seed's | hardware (`--target`, nodes x devices) | verdict | memory per device |",
             "|---|---|---|---|---|"]
    for v in verdicts:
        r = v.recipe
        memory = f"{v.memory_per_device / GIB:,.2f} GiB" if v.memory_per_device is not None else "n/a"
        verdict = ("accepted" if v.accepted else
                   "refused: " + "; ".join(f"`{k}`" for k in dict.fromkeys(reason_key(x) for x in v.reasons)))
        seed = f"`{r.seed}`, " + ("as written" if r.as_written else "rewritten (its header says how)")
        lines.append(f"| `{r.name}` | {seed} | `{r.target}`, {r.nodes} x {r.devices_per_node} | {verdict} | "
                     f"{memory} |")
    return "\n".join(lines) + "\n"


def header_block(verdict: Verdict) -> str:
    """The lines of a recipe's config header, between :data:`HEADER_BEGIN` and :data:`HEADER_END`,
    that say what hardware it needs and what ``posttrain plan --target`` prints for it."""
    r, memory = verdict.recipe, verdict.memory_per_device
    size = r.parsed_target().memory_bytes / GIB
    estimate = (f"{memory / GIB:,.2f} GiB per device estimated" if memory is not None else "no memory estimate")
    lines = [HEADER_BEGIN, f"# Hardware: {r.hardware}; {r.nodes} node(s) x {r.devices_per_node} devices.",
             f"#   {r.command}"]
    if verdict.accepted:
        lines.append(f"# accepts it: {estimate}, of {size:,.0f} GiB.")
    else:
        keys = ", ".join(dict.fromkeys(reason_key(x) for x in verdict.reasons))
        lines.append(f"# refuses it ({estimate}, of {size:,.0f} GiB), naming: {keys}.")
    lines += ["# (every reason in full: python -m posttrain.commands.seed_plans; the table: docs/parallelism.md)",
              HEADER_END]
    wrapped = []
    for line in lines:  # the project's 120 columns
        while len(line) > 120:
            cut = line.rfind(" ", 0, 120)
            wrapped.append(line[:cut])
            line = "#   " + line[cut + 1:]
        wrapped.append(line)
    return "\n".join(wrapped) + "\n"


def replace_header(text: str, block: str) -> str:
    """A config's text with its header block replaced (or added at the end of the header)."""
    if HEADER_BEGIN in text:
        start = text.index(HEADER_BEGIN)
        end = text.index("\n" + HEADER_END + "\n", start) + len(HEADER_END) + 2
        return text[:start] + block + text[end:]
    start = text.index("defaults:")
    return text[:start] + block + text[start:]


def replace_table(doc: str, table: str) -> str:
    """``doc`` with the text between :data:`BEGIN` and :data:`END` replaced by ``table``."""
    start, end = doc.index(BEGIN) + len(BEGIN), doc.index(END)
    return doc[:start] + "\n" + table + doc[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m posttrain.commands.seed_plans", description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite the table in {DOC_PATH}")
    args = parser.parse_args(argv)
    verdicts = [plan_recipe(r) for r in SEED_RECIPES]
    table = render_table(verdicts)
    if args.write:
        _rewrite(Path(DOC_PATH), lambda text: replace_table(text, table))
        for v in verdicts:
            _rewrite(CONFIGS / f"{v.recipe.name}.yaml", lambda text, v=v: replace_header(text, header_block(v)))
        return 0
    sys.stdout.write(table)
    for v in verdicts:
        print(f"\n{v.recipe.command}")
        print("\n".join(f"  {line}" for line in v.reasons) or "  accepted")
    return 0


def _rewrite(path: Path, change) -> None:
    """``path`` with ``change(text)`` written to a temporary file, then renamed over it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(change(path.read_text(encoding="utf-8")), encoding="utf-8")
    tmp.replace(path)
    print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
