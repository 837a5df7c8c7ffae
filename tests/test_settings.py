"""One edit per knob: every setting declared on a config dataclass is a CLI flag, an EngineArgs field, an
LLM keyword and a row of docs/configuration.md, with one default and one set of choices, and its value
reaches its config from each entry point."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from tideserve import LLM
from tideserve.cli import build_parser, parse_command_line
from tideserve.cli_engine_args import engine_kwargs
from tideserve.cli_reference import render
from tideserve.config import (
    CacheConfig,
    KVEventsConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from tideserve.core.kv_cache.elastic import ElasticConfig
from tideserve.engine.arg_utils import ENGINE_SETTINGS, EngineArgs
from tideserve.pooling_params import PoolerConfig
from tideserve.settings import (
    KV_GROUP,
    add_setting_arguments,
    args_fields,
    build_config,
    setting,
    settings_fields,
    values_from,
)

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"

# (Python value, command-line text, what the config holds) of one non-default value per setting. A new
# setting needs a row here: the test below then proves it reaches its config from Python and the CLI.
SAMPLES = {
    "model": ("m.gguf", "m.gguf", "m.gguf"),
    "dtype": ("half", "half", "float16"),
    "device": ("cpu", "cpu", "cpu"),
    "max_model_len": (300, "300", 300),
    "allow_long_max_model_len": (True, None, True),
    "seed": (7, "7", 7),
    "quantization": ("none", "none", "none"),
    "enforce_eager": (True, None, True),
    "batch_invariant": (False, None, False),
    "attention_backend": ("torch", "torch", "torch"),
    "max_logprobs": (5, "5", 5),
    "enable_sleep_mode": (True, None, True),
    "cpu_offload_gb": (4.0, "4", 4.0),
    "pooler_config": ({"pooling_type": "mean", "normalize": False},
                      '{"pooling_type": "MEAN", "normalize": false}',
                      PoolerConfig(pooling_type="MEAN", normalize=False)),
    "block_size": (32, "32", 32),
    "num_blocks": (64, "64", 64),
    "kv_cache_memory": ("1GiB", "1GiB", 2**30),
    "gpu_memory_utilization": (0.5, "0.5", 0.5),
    "kv_cache_dtype": ("bfloat16", "bfloat16", "bfloat16"),
    "enable_prefix_caching": (False, None, False),
    "swap_space": ("512MiB", "512MiB", 0.5),
    "kv_cache_dir": ("/tmp/kv", "/tmp/kv", "/tmp/kv"),
    "kv_cache_dir_size": ("2GiB", "2GiB", 2 * 2**30),
    "kv_offloading_size": ("512MiB", "512MiB", 0.5),
    "max_num_seqs": (9, "9", 9),
    "max_num_batched_tokens": (4096, "4096", 4096),
    "enable_chunked_prefill": (False, None, False),
    "preemption_mode": ("swap", "swap", "swap"),
    "scheduling_policy": ("priority", "priority", "priority"),
    "tensor_parallel_size": (2, "2", 2),
    "pipeline_parallel_size": (1, "1", 1),
    "data_parallel_size": (1, "1", 1),
    "adaptive_threads": (False, None, False),
    "worker_extension_cls": ("my_pkg.ext.Probe", "my_pkg.ext.Probe", "my_pkg.ext.Probe"),
    "kv_cache_shrink_delay": (0.5, "0.5", 0.5),
    "kv_events_config": ({"enable_kv_cache_events": True, "topic": "t"},
                         '{"enable_kv_cache_events": true, "topic": "t"}',
                         KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", topic="t")),
    "speculative_config": ({"method": "ngram", "num_speculative_tokens": 3},
                           '{"method": "ngram", "num_speculative_tokens": 3}',
                           SpeculativeConfig(method="ngram", num_speculative_tokens=3)),
}


def _serve_actions() -> dict[str, argparse.Action]:
    parser = build_parser()
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    return {name: action for action in serve._actions for name in action.option_strings}


def _config_of(s, configs) -> object:
    return next(c for c in configs if isinstance(c, s.config))


def _configs(args: EngineArgs) -> tuple:
    return (*args.configs(), args.parallel_config(), args.elastic_config())


def test_every_config_field_is_a_setting():
    declared = {(s.config, s.field_name) for s in ENGINE_SETTINGS}
    for config in (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig):
        for f in dataclasses.fields(config):
            assert (config, f.name) in declared, f"{config.__name__}.{f.name} is not declared with setting()"
    assert (ElasticConfig, "shrink_delay_s") in declared
    assert set(SAMPLES) == {s.name for s in ENGINE_SETTINGS}, "give each new setting a SAMPLES row"


def test_every_setting_is_a_flag_an_engine_arg_and_a_doc_row_with_one_default():
    actions = _serve_actions()
    args_defaults = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    doc_rows = {line.split(" | ")[0].removeprefix("| "): line for line in DOC.read_text().splitlines()
                if line.startswith("| `")}
    defaults = _configs(EngineArgs())
    for s in ENGINE_SETTINGS:
        assert args_defaults[s.name] == s.arg_default, s.name
        assert getattr(_config_of(s, defaults), s.field_name) == s.default, s.name
        action = actions.get(s.flag) or actions["--no-" + s.flag[2:]]
        assert action.dest == s.name
        if not isinstance(action, argparse._StoreFalseAction):
            assert action.default == s.arg_default, s.name
        row = next(row for names, row in doc_rows.items() if f"`{action.option_strings[0]}`" in names.split(", "))
        if isinstance(s.default, bool) and not isinstance(action, argparse._StoreFalseAction):
            assert f"| {'on' if s.default else 'off'} |" in row, row
        elif s.arg_default is not None and not isinstance(s.default, bool):
            assert f"| `{s.arg_default}` |" in row, row
        if s.spec.choices and s.spec.parser_choices:
            assert list(action.choices) == list(s.spec.choices), s.name
            assert f"Choices: {', '.join(map(str, s.spec.choices))}." in row, row
        elif s.spec.choices:
            assert action.metavar == "{" + ",".join(map(str, s.spec.choices)) + "}", s.name


def test_a_bare_command_line_gives_engine_args_defaults():
    cl = parse_command_line(["serve"])
    assert cl.errors == []
    assert engine_kwargs(cl.ns) == {s.name: s.arg_default for s in ENGINE_SETTINGS}


def test_every_setting_reaches_its_config_from_python_and_from_the_cli():
    from_python = _configs(EngineArgs(**{name: value for name, (value, _, _) in SAMPLES.items()}))
    argv = ["serve"]
    for s in ENGINE_SETTINGS:
        _, text, _ = SAMPLES[s.name]
        if text is None:  # a switch: the flag that turns the default around
            argv.append(s.flag if s.default is False else "--no-" + s.flag[2:])
        else:
            argv += [s.flag, text]
    cl = parse_command_line(argv)
    assert cl.errors == [], cl.errors
    from_cli = _configs(EngineArgs(**engine_kwargs(cl.ns)))
    for s in ENGINE_SETTINGS:
        expected = SAMPLES[s.name][2]
        assert getattr(_config_of(s, from_python), s.field_name) == expected, s.name
        assert getattr(_config_of(s, from_cli), s.field_name) == expected, s.name


def test_an_unknown_llm_keyword_names_the_closest_one_before_loading_anything():
    with pytest.raises(ValueError, match=r"unknown engine argument\(s\): \['max_num_seq'\]; known: .*"
                                         r"Did you mean: 'max_num_seq' -> 'max_num_seqs'\?"):
        LLM(max_num_seq=4)
    with pytest.raises(ValueError, match=r"'kv_cache_shrink_delay_s' -> 'kv_cache_shrink_delay'"):
        EngineArgs.coerce({"kv_cache_shrink_delay_s": 1.0})


@dataclasses.dataclass
class _WiderScheduler(SchedulerConfig):
    """A config with one knob more, declared the one way a knob is declared."""

    max_num_waves: int = setting(3, group=KV_GROUP, choices=(1, 3, 5), help="waves per step (default {default})")


def test_a_field_added_to_a_config_shows_up_in_the_parser_the_args_and_the_doc(monkeypatch):
    configs = [_WiderScheduler if c is SchedulerConfig else c for c in
               (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, ElasticConfig)]
    settings = settings_fields(*configs)
    monkeypatch.setattr("tideserve.engine.arg_utils.ENGINE_SETTINGS", tuple(settings))
    parser = build_parser()
    help_text = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)) \
        .choices["serve"].format_help()
    assert "--max-num-waves {1,3,5}" in help_text and "waves per step (default 3)" in help_text
    assert "| `--max-num-waves` | `3` | waves per step (default 3) Choices: 1, 3, 5. |" in render(parser)
    assert parser.parse_args(["serve", "--max-num-waves", "5"]).max_num_waves == 5
    # An EngineArgs-like class generated from the same settings carries it to the config.
    args_class = dataclasses.make_dataclass("WiderArgs", args_fields(settings))
    assert args_class().max_num_waves == 3
    ns = argparse.ArgumentParser()
    add_setting_arguments(ns, settings)
    values = values_from(ns.parse_args(["--max-num-waves", "1"]), settings)
    assert build_config(_WiderScheduler, settings, args_class(**values)).max_num_waves == 1


def test_every_server_setting_is_a_serve_flag_and_reaches_server_config(monkeypatch):
    from tideserve.cli import server_config
    from tideserve.serve.config import SERVER_SETTINGS, ServerConfig

    declared = {s.field_name for s in SERVER_SETTINGS}
    assert {f.name for f in dataclasses.fields(ServerConfig)} - declared == {"max_n"}  # no flag, by design
    actions = _serve_actions()
    doc = DOC.read_text()
    for s in SERVER_SETTINGS:
        assert actions[s.flag].dest == s.name and actions[s.flag].default == s.arg_default, s.name
        assert f"| `{s.flag}` |" in doc, s.flag
    monkeypatch.delenv("TIDESERVE_API_KEY", raising=False)
    assert server_config(parse_command_line(["serve"]).ns) == ServerConfig()
    cl = parse_command_line(["serve", "--port", "9001", "--api-key", "a", "--api-key", "b", "--max-body-size",
                             "1MiB", "--disable-log-stats", "--engine-stall-timeout", "0"])
    assert cl.errors == []
    config = server_config(cl.ns)
    assert (config.port, config.api_keys, config.max_body_bytes) == (9001, ("a", "b"), 2**20)
    assert config.disable_log_stats and config.engine_stall_timeout == 0
    monkeypatch.setenv("TIDESERVE_API_KEY", "sk-env")
    assert server_config(parse_command_line(["serve"]).ns).api_keys == ("sk-env",)
