"""The compile pool (``recipes/_planner/compile_pool.py``): a worker that dies while compiling
a plan (XLA:CPU aborts on some plans, e.g. ``fsdp_pp`` in bf16 on 8 devices) fails that plan
alone, the others still compile in a fresh worker, and the search never writes the crashed
plan as the best. The crash is simulated by the worker's test hook (``CRASH_ENV``: it calls
``os.abort()``, the SIGABRT of XLA's check failures, before compiling that key; ``KILL_ENV``
sends it the SIGKILL of the out-of-memory killer).
"""

import pytest
from plan_testlib import TINY, plan_config

from recipes import chips, plan
from recipes._planner import compile_pool
from recipes.config import load_config

V5E = chips.get_chip("v5e")


def _search(cfg, compile_top, cache=None):
  return plan.search(cfg, devices=8, chip=V5E, presets=["data_parallel", "fsdp"],
                     remats=["none"], max_microbatches=1, compile_top=compile_top,
                     cache=cache, attention="xla")


@pytest.mark.slow
def test_a_worker_crash_fails_its_plan_alone_and_is_never_the_best(tmp_path, monkeypatch):
  cfg = plan_config()
  screened = _search(cfg, compile_top=0)
  crash, *others = [r.candidate for r in screened.results if r.fits][:3]
  assert len(others) == 2
  key = plan.cache_key(plan.candidate_config(cfg, crash), 8)
  monkeypatch.setenv(compile_pool.CRASH_ENV, key)
  cache = plan.Cache(tmp_path / "cache.json")
  found = _search(cfg, compile_top=3, cache=cache)   # the crash is the first compiled
  # the two plans after it compiled in a fresh worker
  assert found.num_compiled == 3
  for c in others:
    r = next(r for r in found.results if r.candidate == c)
    assert r.compiled and r.compiled["memory"]["peak"] > 0 and r.error is None
  # the crashed plan: reported with how the worker died, its label and whose fault it is
  assert found.results[-1].candidate == crash and not found.results[-1].runnable
  why = found.failed[crash.label()]
  assert f"the compile worker died (killed by signal 6, SIGABRT) while compiling " \
         f"{crash.label()}" in why
  assert "crash inside XLA:CPU's compiler, not a mistake in the config" in why
  assert found.best.candidate in others
  # cached as a failure, as any failed compile: a rerun compiles nothing
  monkeypatch.delenv(compile_pool.CRASH_ENV)
  again = _search(cfg, compile_top=3, cache=plan.Cache(tmp_path / "cache.json"))
  assert again.num_compiled == 0 and again.failed == found.failed


@pytest.mark.slow
def test_the_cli_writes_the_best_plan_that_did_not_crash(tmp_path, monkeypatch, capsys):
  cfg = plan_config()
  crash = next(r.candidate for r in _search(cfg, compile_top=0).results if r.fits)
  monkeypatch.setenv(compile_pool.CRASH_ENV, plan.cache_key(plan.candidate_config(cfg, crash),
                                                            8))
  out = tmp_path / "best.yaml"
  code = plan.main(["--devices", "8", "--chip", "v5e", "--preset", "data_parallel",
                    "--preset", "fsdp", "--remat", "none", "--max-microbatches", "1",
                    "--compile", "2", "--attention", "xla", "--cache", "", "--out", str(out),
                    *TINY])
  text = capsys.readouterr().out
  assert code == 0
  assert f"compiling {crash.label()} failed" in text and "SIGABRT" in text
  written = load_config(out)
  assert (written.preset, written.mesh) != (crash.preset, crash.mesh_dict)


def test_a_worker_that_cannot_start_is_still_an_error(monkeypatch):
  """A worker that dies before it starts any plan (here: Python cannot start, its
  PYTHONHOME is missing) is not blamed on a plan: the batch fails with the worker's
  message."""
  env = compile_pool._worker_env()
  monkeypatch.setattr(compile_pool, "_worker_env",
                      lambda: {**env, "PYTHONHOME": "/no-such-python-home"})
  with pytest.raises(plan.PlanError, match=r"failed \(exit code 1\) before compiling a plan"):
    compile_pool.compile_many({"k": plan_config()}, 8)


@pytest.mark.slow
def test_a_worker_killed_for_memory_is_not_blamed_on_xla_nor_cached(tmp_path, monkeypatch):
  """SIGKILL is what Linux's out-of-memory killer sends: the message said "a crash inside
  XLA:CPU's compiler" and the cache kept the failure, so a rerun with free memory never
  compiled the plan again."""
  cfg = plan_config()
  killed, other = [r.candidate for r in _search(cfg, compile_top=0).results if r.fits][:2]
  monkeypatch.setenv(compile_pool.KILL_ENV, plan.cache_key(plan.candidate_config(cfg, killed),
                                                           8))
  found = _search(cfg, compile_top=2, cache=plan.Cache(tmp_path / "cache.json"))
  why = found.failed[killed.label()]
  assert f"the compile worker died (killed by signal 9, SIGKILL) while compiling " \
         f"{killed.label()}" in why
  assert "most often the out-of-memory killer" in why and "it is not cached" in why
  assert "XLA:CPU's compiler" not in why
  assert found.best.candidate == other and found.num_compiled == 2
  # the rerun compiles the killed plan (and only it) again, and now it compiles
  monkeypatch.delenv(compile_pool.KILL_ENV)
  again = _search(cfg, compile_top=2, cache=plan.Cache(tmp_path / "cache.json"))
  assert again.num_compiled == 1 and again.failed == {}
  assert next(r for r in again.results if r.candidate == killed).compiled["memory"]["peak"] > 0
