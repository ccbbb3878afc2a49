"""What the recipes' command lines say about bad input: the flag the user typed, what is wrong
with it and how to fix it (exit status 2, no traceback).

Each message is checked against the command line that caused it; the one run trained here is
``test_generate``'s tiny linen run (equal configs compile once per session).
"""

import re

import pytest
from job_testlib import REPO

from recipes import export, generate, plan, train
from recipes.config import load_config

HF_LLAMA = REPO / "tests" / "layers" / "data" / "hf" / "llama"   # vocab_size 96, max_len 64


def exits_2(capsys, parse, argv) -> str:
  """stderr of an argparse-level error (``parser.error``: exit status 2 and the usage)."""
  with pytest.raises(SystemExit) as e:
    parse(argv)
  assert e.value.code == 2
  return capsys.readouterr().err


def generate_err(capsys, argv) -> str:
  assert generate.main(argv) == 2
  err = capsys.readouterr().err
  assert "Traceback" not in err
  return err


# -- recipes.plan ----------------------------------------------------------------------------


@pytest.mark.parametrize("top, said", [("0", "0 shows no plans"), ("-3", "-3 shows no plans"),
                                       ("x", "'x' is not a number of rows")])
def test_plan_top_below_one_is_an_argument_error(capsys, top, said):
  """--top 0 printed an empty table and exited 0 (a negative K dropped the last rows)."""
  err = exits_2(capsys, plan.parse_args, ["--devices", "8", "--chip", "v5e", "--top", top])
  assert f"argument --top: {said}: use --top 1 or more (default 15)" in err


def test_plan_top_one_is_fine():
  assert plan.parse_args(["--devices", "8", "--chip", "v5e", "--top", "1"]).top == 1


# -- recipes.export --------------------------------------------------------------------------


ARCHITECTURE_FIX = ("--architecture qwen2 only applies with --to hf (it picks the Hugging Face "
                    "model class to write); the npz export holds the canonical names, which "
                    "have no architecture. Add --to hf to write a transformers directory as "
                    "qwen2, or leave --architecture out.")


@pytest.mark.parametrize("to", [[], ["--to", "npz"]])
def test_export_architecture_without_to_hf_is_an_argument_error(capsys, to):
  """It was silently ignored: the .npz was written with no word."""
  err = exits_2(capsys, export.parse_args, ["--checkpoint", "runs/x", "--out", "w.npz",
                                            "--architecture", "qwen2", *to])
  assert ARCHITECTURE_FIX in err
  assert export.parse_args(["--checkpoint", "runs/x", "--out", "hf", "--to", "hf",
                            "--architecture", "qwen2"]).architecture == "qwen2"


def test_export_function_refuses_architecture_before_reading_the_checkpoint(tmp_path):
  with pytest.raises(export.ExportError, match=re.escape(ARCHITECTURE_FIX)):
    export.export(tmp_path / "no_run", tmp_path / "w.npz", architecture="qwen2")


# -- recipes.init_from (through the command lines that load a config) ------------------------


def test_init_from_conflicts_nest_under_the_one_problem_counted(capsys):
  """The config's ``1 problem(s)`` came with three bullets at its own depth (the init_from
  problem and its two conflicts)."""
  err = generate_err(capsys, [f"init_from={HF_LLAMA}", "model.num_layers=3",
                              "model.max_len=999", "--tokens", "1"])
  lines = err.splitlines()
  assert lines[0] == "error: config: 1 problem(s)."
  assert [x for x in lines if x.startswith("  * ")] == [
      f"  * init_from: init_from={str(HF_LLAMA)!r}: 2 model override(s) contradict the "
      "checkpoint's config.json:"]
  assert [x for x in lines if x.lstrip().startswith("- ")] == [
      "      - model.max_len=999, but the checkpoint has max_len=64",
      "      - model.num_layers=3, but the checkpoint has num_layers=2"]
  assert "\n      Drop these model.* overrides" in err


def test_init_from_conflicts_count_their_lines(tmp_path):
  from recipes import init_from
  config = load_config(train.default_config_path(), ["model.num_layers=4"])
  with pytest.raises(init_from.InitFromError) as e:
    init_from.resolve_model(HF_LLAMA, config.model, {"num_layers"})
  message = str(e.value)
  assert message.startswith(f"init_from={str(HF_LLAMA)!r}: 1 model override(s) contradict")
  assert message.count("\n  - ") == 1


# -- recipes.generate: sampling flags --------------------------------------------------------


@pytest.mark.parametrize("argv, bullet", [
    (["--temperature", "-1"], "--temperature -1.0: temperature=-1.0 must be a finite number "
                              ">= 0 (0 = greedy)"),
    (["--temperature", "nan"], "--temperature nan: temperature=nan must be a finite number"),
    (["--top-k", "-2", "--temperature", "1"], "--top-k -2: top_k=-2 must be an int >= 0"),
    (["--top-p", "1.5"], "--top-p 1.5: top_p=1.5 must be in (0, 1] (1.0 = no nucleus cut)"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0: max_new_tokens=0 must be an int >= 1"),
    (["--stop", "-1"], "--stop -1: stop_tokens has [-1]: token ids are ints >= 0"),
    (["--top-k", "3"], "--top-k 3, --temperature 0.0: top_k=3 / top_p=1.0 cut the "
                       "distribution sampled from, but temperature=0 is greedy (argmax)"),
    (["--top-k", "3", "--top-p", "0.5"], "--top-k 3, --top-p 0.5, --temperature 0.0: top_k=3"),
])
def test_generate_sampling_errors_name_the_flags(capsys, argv, bullet):
  """They named layers.Sampling's fields: 'Sampling: 1 invalid setting(s)' and the fix
  'e.g. Sampling(temperature=0.8, top_p=0.9)'."""
  err = generate_err(capsys, [f"init_from={HF_LLAMA}", "--tokens", "3", *argv])
  assert err.startswith("error: python -m recipes.generate: 1 problem(s) with the sampling "
                        "flags.\n")
  assert f"  * {bullet}" in err
  assert err.rstrip().endswith("Fix the flags listed above, e.g. --temperature 0.8 "
                               "--top-p 0.9.")
  assert "Sampling" not in err


def test_generate_lists_every_bad_sampling_flag(capsys):
  err = generate_err(capsys, [f"init_from={HF_LLAMA}", "--tokens", "3", "--temperature", "-1",
                              "--top-p", "0", "--max-new-tokens", "0"])
  assert "3 problem(s) with the sampling flags" in err
  assert err.count("\n  * ") == 3


def test_generate_stop_outside_the_vocabulary_names_stop(capsys):
  err = generate_err(capsys, [f"init_from={HF_LLAMA}", "--tokens", "3", "--stop", "500"])
  assert ("--stop 500: stop token(s) [500] are not in the model's vocabulary (vocab_size=96, "
          "ids 0..95). Pass --stop ids below that, or leave --stop out") in err


# -- recipes.generate: prompts ---------------------------------------------------------------


def test_generate_out_of_vocab_ids_say_which_and_the_vocab_size(capsys):
  """The message said 'Shorten the prompts (or use a model with a larger max_len)'."""
  err = generate_err(capsys, [f"init_from={HF_LLAMA}", "--tokens", "3 9999", "--tokens",
                              "1 -1 200"])
  assert "2 problem(s) with the prompts" in err
  assert ("  * --tokens '3 9999': id 9999 is out of range for the model's vocab_size=96 "
          "(ids 0..95): pass ids from 0 to 95") in err
  assert "  * --tokens '1 -1 200': ids -1, 200 are out of range for the model's vocab_size=96" \
         in err
  assert "Shorten" not in err and "max_len" not in err


def test_generate_long_prompt_names_it_and_the_fix(capsys):
  err = generate_err(capsys, [f"init_from={HF_LLAMA}", "--tokens", "3", "--tokens",
                              " ".join(["3"] * 65)])
  assert ("  * prompt(s) [1] have 65 tokens > the model's max_len=64 (--tokens '3 3 3 3 3 3 "
          "3 3 3 3 ...'): shorten them (the checkpoint's config.json sets max_len; "
          "model.max_len may only lower it)") in err
