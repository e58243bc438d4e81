"""Every `EngineConfig` field is a server flag, a bench flag and an `LLM` keyword, and every `SamplingParams`
field a client flag that reaches the server's SamplingParams: all derived from `dataclasses.fields`, so a new
field that one front end misses fails here. Flags given round-trip to the same config as the keywords."""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing

import pytest

from sarathi_jax import llm as llm_module
from sarathi_jax.bench import args as bench_args
from sarathi_jax.config.engine_config import EngineConfig
from sarathi_jax.config.flags import ConfigFlags, field_docs, int_list
from sarathi_jax.request.sampling_params import SamplingParams
from server import __main__ as server_main
from server import client
from server.grpc_service import sampling_params_from_proto

ENGINE_FIELDS = [f.name for f in dataclasses.fields(EngineConfig)]
SAMPLING_FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]


def other_value(cls: type, name: str) -> object:
    """A valid value of field `name` other than its default, chosen from the field's type alone (a type with
    no rule here fails, so a new kind of field gets one)."""
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    kind = typing.get_type_hints(cls)[name]
    if isinstance(kind, types.UnionType):  # X | None -> X
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    default = field.default
    if "choices" in field.metadata:
        return next(c for c in reversed(field.metadata["choices"]) if c != default)
    if name == "structured_outputs":  # a JSON object on the command line
        return {"regex": "[a-z]+"}
    if name == "speculative_config":  # a JSON object too (vLLM's dict)
        return {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    if name == "disaggregation":  # "P:D"
        return "1:1"
    if kind is bool:
        return not default if default is not None else True
    if kind is int:  # multiples of 16: token budgets; 16 <= max_tokens 16 for min_tokens; <= 20 logprobs
        return 16 if default in (None, 0, 1) else default + 16
    if kind is float:
        return 0.5
    if kind is str:
        return "off" if name == "compilation_cache_dir" else "llama-1b"
    if kind == tuple[str, ...]:
        return ("a,b", "c")  # a comma stays inside one stop string
    if kind == tuple[int, ...]:
        return (1, 2, 3)
    raise AssertionError(f"{cls.__name__}.{name}: no test value for {kind!r}")


def argv_for(flags: ConfigFlags, name: str, value: object) -> list[str]:
    """The command line that says field `name` = `value`."""
    flag = flags.flag(name)
    if isinstance(value, bool):
        return [flag if value else "--no-" + flag[2:]]
    if isinstance(value, tuple) and value and isinstance(value[0], str):
        return [part for item in value for part in (flag, item)]
    if isinstance(value, tuple):
        return [flag, ",".join(map(str, value))]
    if isinstance(value, dict):
        return [flag, json.dumps(value)]
    return [flag, str(value)]


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


def test_every_field_is_documented_for_its_help():
    assert set(field_docs(EngineConfig)) >= set(ENGINE_FIELDS)
    assert set(field_docs(SamplingParams)) >= set(SAMPLING_FIELDS)
    assert field_docs(SamplingParams)["min_tokens"] == field_docs(SamplingParams)["max_tokens"]  # "a / b: text"
    assert "sizing.py). None: 0.9" in field_docs(EngineConfig)["gpu_memory_utilization"]  # continuation lines


def test_server_has_a_flag_for_every_engine_field_and_round_trips():
    parser = server_main.build_parser()
    assert {"--" + name.replace("_", "-") for name in ENGINE_FIELDS} <= option_strings(parser)
    assert server_main.engine_config_from_args(parser.parse_args([])) == EngineConfig()
    for name in ENGINE_FIELDS:
        value = other_value(EngineConfig, name)
        config = server_main.engine_config_from_args(parser.parse_args(argv_for(server_main.ENGINE_FLAGS, name, value)))
        assert config == EngineConfig(**{name: value}), name
        assert getattr(config, name) != getattr(EngineConfig(), name), name


def test_bench_has_a_flag_for_every_engine_field_and_round_trips():
    parser = bench_args.build_parser()
    generated = bench_args.ENGINE_FLAGS
    flags = {name: bench_args.HAND_WRITTEN_ENGINE_FLAGS.get(name) or generated.flag(name) for name in ENGINE_FIELDS}
    assert set(flags.values()) <= option_strings(parser)
    assert flags["seed"] == "--engine-seed" and "--seed" in option_strings(parser)  # --seed: the workload's
    run = {"scheduler": "sarathi", "token_budget": 64}
    defaults = bench_args.engine_config_kwargs(parser.parse_args(["--model", "tiny-llama"]), run)
    assert defaults == {"model": "tiny-llama", "scheduler": "sarathi", "token_budget": 64,
                        "enable_prefix_caching": False, "max_num_seqs": bench_args.DEFAULT_MAX_NUM_SEQS,
                        "max_model_len": bench_args.DEFAULT_MAX_MODEL_LEN}  # no generated flag given: nothing more
    for name in generated.names():
        value = other_value(EngineConfig, name)
        kwargs = bench_args.engine_config_kwargs(parser.parse_args(["--model", "tiny-llama",
                                                                    *argv_for(generated, name, value)]), run)
        assert kwargs == {**defaults, name: value}, name
        assert EngineConfig(**kwargs) == EngineConfig(**defaults, **{name: value}), name


def test_llm_takes_exactly_the_engine_fields_as_keywords(monkeypatch):
    built = []
    monkeypatch.setattr(llm_module, "build_engine", lambda config, warmup: built.append((config, warmup)))
    for name in ENGINE_FIELDS[1:]:  # model: the positional argument
        value = other_value(EngineConfig, name)
        llm_module.LLM("tiny-llama", warmup=False, **{name: value})
        assert built.pop() == (EngineConfig(model="tiny-llama", **{name: value}), False), name
    llm_module.LLM(model="llama-1b")
    assert built.pop() == (EngineConfig(model="llama-1b"), True)
    with pytest.raises(TypeError, match="token_budgets"):
        llm_module.LLM("tiny-llama", token_budgets=64)


def test_client_flags_carry_every_sampling_field_to_the_server():
    parser = argparse.ArgumentParser()
    client.SAMPLING_FLAGS.add_to(parser)
    given = {name: other_value(SamplingParams, name) for name in SAMPLING_FIELDS}
    argv = [part for name, value in given.items() for part in argv_for(client.SAMPLING_FLAGS, name, value)]
    values = client.SAMPLING_FLAGS.given(parser.parse_args(argv))
    assert values == given
    expected = SamplingParams(**given)
    assert all(getattr(expected, name) != getattr(SamplingParams(), name) for name in SAMPLING_FIELDS)
    assert sampling_params_from_proto(client.make_request([1], **values)) == expected
    assert client.SAMPLING_FLAGS.given(parser.parse_args([])) == {}  # nothing given: nothing sent
    assert sampling_params_from_proto(client.make_request([1])) == SamplingParams()


def test_flag_forms_and_mistakes():
    flags = ConfigFlags(SamplingParams, skip=frozenset({"stop"}), renamed={"seed": "--sampling-seed"})
    parser = argparse.ArgumentParser()
    flags.add_to(parser)
    assert "--stop" not in option_strings(parser) and "--sampling-seed" in option_strings(parser)
    args = parser.parse_args(["--sampling-seed", "7", "--stop-token-ids", "1,2", "--stop-token-ids", "3",
                              "--no-ignore-eos"])
    assert flags.given(args) == {"seed": 7, "stop_token_ids": (1, 2, 3), "ignore_eos": False}
    assert int_list("4, 5,") == [4, 5]
    with pytest.raises(SystemExit):
        parser.parse_args(["--top-k", "many"])
    with pytest.raises(SystemExit):  # choices come from the field's metadata
        server_main.build_parser().parse_args(["--dtype", "float16"])
    with pytest.raises(ValueError, match="no fields"):
        ConfigFlags(EngineConfig, skip=frozenset({"token_budgets"}))

    @dataclasses.dataclass(frozen=True)
    class Undocumented:
        """No entries."""

        size: int = 1

    with pytest.raises(ValueError, match="Undocumented.size has no"):
        ConfigFlags(Undocumented).add_to(argparse.ArgumentParser())


def test_none_sets_an_optional_field_whose_default_is_not_none():
    parser = server_main.build_parser()
    given = server_main.ENGINE_FLAGS.given
    assert EngineConfig().priority_max_wait_s is not None
    for text in ("none", "None", "NONE"):
        args = parser.parse_args(["--scheduling-policy", "priority", "--priority-max-wait-s", text])
        assert given(args) == {"scheduling_policy": "priority", "priority_max_wait_s": None}
        assert server_main.engine_config_from_args(args).priority_max_wait_s is None
    assert given(parser.parse_args(["--compilation-cache-dir", "none"])) == {"compilation_cache_dir": None}
    assert given(parser.parse_args(["--priority-max-wait-s", "5"])) == {"priority_max_wait_s": 5.0}
    assert "priority_max_wait_s" not in given(parser.parse_args([]))  # left out: the default applies
    with pytest.raises(SystemExit):
        parser.parse_args(["--priority-max-wait-s", "never"])
    with pytest.raises(SystemExit):  # an Optional field whose default is None: left out is already None
        parser.parse_args(["--max-token-budget", "none"])
