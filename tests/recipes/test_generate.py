"""``python -m recipes.generate``: continuations of a training run or a Hugging Face directory.

References: greedy decoding by re-running the full forward pass (``layers._model.transformer``)
on the growing sequence, with weights read independently of the command (``recipes.export``
for a run, ``layers.from_hf`` for a directory); the ``tokenizers`` package's own encoding.
"""

import json
import re
import shutil

import jax
import jax.numpy as jnp
import pytest
from greedy_testlib import greedy_reference as greedy
from job_testlib import REPO, TINY

import layers
import layers.linen
from recipes import export, generate, train
from recipes.config import load_config

HF_LLAMA = REPO / "tests" / "layers" / "data" / "hf" / "llama"
FIELDS = re.compile(r"ids: ?([\d ]*)$", re.M)


def linen_params(weights, cfg):
  like = layers.linen.Transformer(cfg).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
  return layers.linen.decode_params(layers.from_canonical(weights, like=like), cfg)


def run_cli(capsys, argv):
  rc = generate.main(argv)
  captured = capsys.readouterr()
  return rc, captured.out, captured.err


def continuations(out):
  return [[int(t) for t in m.split()] for m in FIELDS.findall(out)]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  """The Llama golden checkpoint with a word-level tokenizer.json next to it."""
  tokenizers = pytest.importorskip("tokenizers")
  path = tmp_path_factory.mktemp("hf") / "llama"
  shutil.copytree(HF_LLAMA, path)
  words = ["<pad>", "<s>", "</s>"] + [f"w{i}" for i in range(93)]
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)},
                                                         unk_token="<pad>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.save(str(path / "tokenizer.json"))
  return path


@pytest.mark.slow  # a decode loop / several models: runs in the full suite
def test_hf_directory_text_prompts_equal_greedy_reference(hf_dir, capsys):
  rc, out, err = run_cli(capsys, ["init_from=" + str(hf_dir), "--prompt", "w7 w20 w3",
                                  "--prompt", "w50", "--max-new-tokens", "5"])
  assert rc == 0, err
  weights, cfg = layers.from_hf(hf_dir)
  params = linen_params(weights, cfg)
  eos = json.loads((hf_dir / "config.json").read_text())["eos_token_id"]
  want = [greedy(params, cfg, p, 5, stop=(eos,)) for p in ([10, 23, 6], [53])]
  assert continuations(out) == want
  assert re.search(r"prefill: 4 tokens in [\d.]+ ms \([\d,]+ tokens/s\); decode: \d+ tokens",
                   out)
  assert "-> w" in out   # decoded back to words by the tokenizer


def test_token_ids_without_tokenizer(capsys):
  rc, out, err = run_cli(capsys, ["init_from=" + str(HF_LLAMA), "--tokens", "1 5 9",
                                  "--max-new-tokens", "4", "--stop", "2",
                                  "mesh={data: 2, fsdp: 2, tensor: 2}"])
  assert rc == 0, err
  weights, cfg = layers.from_hf(HF_LLAMA)
  assert continuations(out) == [greedy(linen_params(weights, cfg), cfg, [1, 5, 9], 4, (2,))]


@pytest.mark.parametrize("argv, match", [
    (["--tokens", " ".join(["3"] * 65)], r"prompt\(s\) \[0\] have 65 tokens > the model's "
                                         r"max_len=64"),
    (["--tokens", "3", "--stop", "500"], r"stop token\(s\) \[500\] are not in the model's "
                                         r"vocabulary"),
    (["--tokens", "3", "--top-p", "0"], r"top_p=0.0 must be in \(0, 1\]"),
    (["--tokens", "3", "--top-p", "1.2"], r"top_p=1.2 must be in \(0, 1\]"),
    (["--prompt", "hello"], r"--prompt needs a tokenizer, but .* has no tokenizer.json"),
    (["--tokens", "3 x"], r"--tokens '3 x': give integer ids"),
    ([], "no prompt: pass --prompt TEXT or --tokens"),
])
def test_bad_input_exits_2_naming_it(capsys, argv, match):
  rc, _, err = run_cli(capsys, ["init_from=" + str(HF_LLAMA), *argv])
  assert rc == 2
  assert re.search(match, err), err


def test_unexpressible_checkpoint_exits_2(tmp_path, capsys):
  shutil.copytree(HF_LLAMA, tmp_path / "m")
  config = json.loads((tmp_path / "m" / "config.json").read_text())
  config["hidden_act"] = "gelu"
  (tmp_path / "m" / "config.json").write_text(json.dumps(config))
  rc, _, err = run_cli(capsys, [f"init_from={tmp_path / 'm'}", "--tokens", "1 2"])
  assert rc == 2
  assert "hidden_act='gelu'" in err


def test_no_model_exits_2(capsys):
  rc, _, err = run_cli(capsys, ["--tokens", "1 2"])
  assert rc == 2 and "no model: pass --checkpoint runs/x" in err


@pytest.fixture(scope="module", params=["nnx", "haiku"])
def tiny_run(request, tmp_path_factory):
  out = tmp_path_factory.mktemp(f"run_{request.param}")
  config = load_config(train.default_config_path(),
                       [*TINY, "seq_len=16", f"framework={request.param}", f"out_dir={out}"])
  train.train(config, progress=False, out=open("/dev/null", "w"))
  return out


@pytest.mark.slow
def test_run_checkpoint_digits_and_ids_equal_greedy_reference(tiny_run, capsys):
  rc, out, err = run_cli(capsys, ["--checkpoint", str(tiny_run), "--prompt", "3141",
                                  "--tokens", "4 5 1"])
  assert rc == 0, err
  weights = export.restore_params(tiny_run)[0]
  cfg = export.model_config(export.restore_params(tiny_run)[1])
  params = linen_params(layers.to_canonical(weights), cfg)
  # Digits d are ids d + 2, then the separator 1; the answer is seq_len // 2 = 8 tokens.
  want = [greedy(params, cfg, [5, 3, 6, 3, 1], 8), greedy(params, cfg, [4, 5, 1], 8)]
  assert continuations(out) == want


@pytest.mark.slow
def test_default_recipe_reverses_the_readme_example(tmp_path, capsys, monkeypatch):
  # as the README runs it: a run directory relative to the working directory
  monkeypatch.chdir(tmp_path)
  assert train.main(["out_dir=runs/default", "plot=false"]) == 0
  capsys.readouterr()
  rc, out, err = run_cli(capsys, ["--checkpoint", "runs/default", "--prompt", "31415926"])
  assert rc == 0, err
  assert "-> 62951413" in out


@pytest.fixture(scope="module")
def linen_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("run_linen")
  config = load_config(train.default_config_path(), [*TINY, "seq_len=16", f"out_dir={out}"])
  train.train(config, progress=False, out=open("/dev/null", "w"))
  return out


@pytest.mark.slow  # trains the run it reads
def test_digit_prompt_of_another_length_gets_a_note(linen_run, capsys):
  """It answered with no word; the model has only seen 8-digit questions."""
  rc, _, err = run_cli(capsys, ["--checkpoint", str(linen_run), "--prompt", "314"])
  assert rc == 0, err
  assert ("note: --prompt '314' has 3 digit(s), but this run's reverse task was trained on "
          "questions of 8 digits (seq_len=16): the model has seen no other length, so expect "
          "a wrong answer. Pass 8 digits (e.g. --prompt 31415926).") in err
  rc, _, err = run_cli(capsys, ["--checkpoint", str(linen_run), "--prompt", "3141 5926"])
  assert rc == 0 and "note:" not in err, err


@pytest.mark.slow  # trains the run it reads
def test_out_of_vocab_ids_in_a_run_checkpoint_name_the_flag(linen_run, capsys):
  vocab = load_config(train.default_config_path(), TINY).model.vocab_size
  rc, _, err = run_cli(capsys, ["--checkpoint", str(linen_run), "--tokens", f"4 {vocab}"])
  assert rc == 2
  assert (f"--tokens '4 {vocab}': id {vocab} is out of range for the model's "
          f"vocab_size={vocab} (ids 0..{vocab - 1})") in err


@pytest.mark.parametrize("override, match", [
    ("framework=nnx", r"framework=nnx here, linen in the checkpoint"),
    ("model.num_layers=3", r"model.num_layers=3 here, 1 in the checkpoint"),
    ("model.num_kv_heads=2", r"model.num_kv_heads=2 here, 1 in the checkpoint"),
    ("model.embed_dim=32", r"model.embed_dim=32 here, 16 in the checkpoint"),
])
def test_overrides_that_change_the_checkpoints_model_exit_2(linen_run, capsys, override,
                                                             match):
  """They used to fail inside the restore (a KeyError from decode_params, a broadcasting
  error from JAX) or, for embed_dim, to be ignored."""
  rc, _, err = run_cli(capsys, ["--checkpoint", str(linen_run), "--tokens", "4 5 1", override])
  assert rc == 2
  assert re.search(match, err), err
  assert "python -m recipes.export" in err


def test_how_the_model_runs_can_change_and_max_len_lets_it_generate_further(linen_run,
                                                                            capsys):
  max_len = export.model_config(export.restore_params(linen_run)[1]).max_len
  argv = ["--checkpoint", str(linen_run), "--tokens", " ".join(["4"] * (max_len - 2)),
          "--max-new-tokens", "6"]
  rc, out, err = run_cli(capsys, argv)
  assert rc == 0, err
  short = continuations(out)[0]
  # the prompt + 2 reach the model's max_len: said on stderr, not silently cut
  assert len(short) == 2
  assert (f"prompt(s) [0] after 2 of 6 new tokens: they reached the model's max_len={max_len}"
          in err)
  rc, out, err = run_cli(capsys, [*argv, f"model.max_len={2 * max_len}",
                                  "model.attention=blockwise"])
  assert rc == 0, err
  longer = continuations(out)[0]
  assert len(longer) == 6 and longer[:2] == short and "note:" not in err


def test_a_hugging_face_checkpoint_at_its_max_len_says_to_shorten_the_prompt(capsys):
  """The note said to pass model.max_len=N, which init_from then refuses (only a smaller
  max_len may be set)."""
  max_len = json.loads((HF_LLAMA / "config.json").read_text())["max_position_embeddings"]
  rc, out, err = run_cli(capsys, ["init_from=" + str(HF_LLAMA), "--tokens",
                                  " ".join(["4"] * (max_len - 2)), "--max-new-tokens", "6"])
  assert rc == 0, err
  assert len(continuations(out)[0]) == 2
  assert (f"they reached the model's max_len={max_len} (the checkpoint's "
          "max_position_embeddings: shorten the prompt to generate further)") in err
  assert "model.max_len=N" not in err


@pytest.mark.parametrize("argv, match", [
    (["--max-new-tokens", "0"], r"max_new_tokens=0 must be an int >= 1"),
    (["--top-k", "3"], r"top_k=3 / top_p=1.0 cut the distribution sampled from, but "
                       r"temperature=0 is greedy"),
    (["--top-p", "0.5"], r"temperature=0 is greedy \(argmax\): set a temperature > 0"),
])
def test_settings_that_would_be_ignored_exit_2(capsys, argv, match):
  rc, _, err = run_cli(capsys, ["init_from=" + str(HF_LLAMA), "--tokens", "3", *argv])
  assert rc == 2
  assert re.search(match, err), err
