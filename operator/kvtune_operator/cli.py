"""The `kvtune` command. Subcommands load lazily so `kvtune sim` never imports torch or kopf."""
from __future__ import annotations

import importlib

import click

# name -> "module:attribute" of a click command; each module owns its own options.
COMMANDS = {
    "crd": ("kvtune_operator.commands:crd", "Print the InferenceDeployment CRD generated from the model."),
    "operator": ("kvtune_operator.commands:operator", "Run the Kubernetes operator (kvtune operator run)."),
    "sim": ("kvtune_engine.sim.cli:sim", "Replay a request trace through the scheduler in virtual time."),
    "trace": ("kvtune_engine.sim.cli:trace", "Generate request traces (scenarios, mixes) or import logs (Azure, BurstGPT, guidellm, inference-perf)."),
    "serve": ("kvtune_engine.server.cli:serve", "Serve a model: OpenAI API, /metrics, admin API /kvtune/v1/."),
    "demo": ("kvtune_operator.demo:demo", "Watch the tuner fix a mis-tuned engine, live, on this machine (no cluster)."),
    "diagnose": ("kvtune_operator.tuner_cli:diagnose_cmd", "Say why requests wait on a live engine (its /metrics and state)."),
    "tune": ("kvtune_operator.tuner_cli:tune_cmd", "Recommend engine flags for a trace (the tuner's loop, in the simulator)."),
    "make-tiny-model": ("kvtune_engine.model.tiny:make_tiny_model_cmd", "Write a small random Llama/Qwen model with a real tokenizer (tests, demo)."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module, _, attr = COMMANDS[name][0].partition(":")
        return getattr(importlib.import_module(module), attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Help text from the table, so `kvtune --help` imports nothing heavy.
        with formatter.section("Commands"):
            formatter.write_dl([(name, COMMANDS[name][1]) for name in self.list_commands(ctx)])


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvtune")
def main() -> None:
    """kvtune: LLM serving on Kubernetes with a KV cache that tunes itself."""
