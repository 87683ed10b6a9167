"""The command's answer cache (memsim.entry): a repeated command is answered from disk without
importing torch; any change to what the answer depends on (the target, a module it imports,
the options) traces again; --no-cache bypasses it."""

import os
import subprocess
import sys
import textwrap

import pytest

from memsim import entry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TARGET = textwrap.dedent("""\
    import torch
    from helper import WIDTH

    def model():
        return torch.nn.Sequential(torch.nn.Linear(8, WIDTH), torch.nn.ReLU(),
                                   torch.nn.Linear(WIDTH, 2))
    """)


def _memsim(tmp_path, *extra):
    """Run the command through its entry in a fresh process: (stdout, torch imported?)."""
    argv = ["analyze", str(tmp_path / "target.py") + ":model", "--input", "input=float32[B,8]",
            "--device", "cpu", "--at", "B=4", "--quiet", *extra]
    code = ("import sys\nfrom memsim.entry import main\nrc = main(%r)\n"
            "print('TORCH', 'torch' in sys.modules)\nsys.exit(rc)" % (argv,))
    env = {**os.environ, "MEMSIM_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, cwd=tmp_path, check=True).stdout
    body, _, flag = out.rpartition("TORCH ")
    return body, flag.strip() == "True"


@pytest.mark.heavy
def test_a_repeated_command_is_answered_from_disk(tmp_path):
    (tmp_path / "target.py").write_text(TARGET)
    (tmp_path / "helper.py").write_text("WIDTH = 16\n")
    first, traced = _memsim(tmp_path)
    assert traced and "Training step" in first
    again, traced = _memsim(tmp_path)
    assert again == first and not traced           # from disk, torch never imported
    # a module the target imports changes: traced again, and the answer changes with it
    (tmp_path / "helper.py").write_text("WIDTH = 32\n")
    changed, traced = _memsim(tmp_path)
    assert traced and changed != first
    # other options are another answer; --no-cache neither reads nor writes
    _, traced = _memsim(tmp_path, "--at", "B=5")
    assert traced
    _, traced = _memsim(tmp_path, "--no-cache")
    assert traced


def test_what_is_not_kept():
    assert entry.cacheable(["analyze", "m.py:f", "--input", "x=float32[B]"])
    assert entry.cacheable(["plan", "m.py:f", "--gpus", "8", "--global-batch", "64"])
    assert not entry.cacheable(["analyze", "m.py:f", "--no-cache"])
    assert not entry.cacheable(["analyze", "m.py:f", "--plot", "p.png"])
    assert not entry.cacheable(["analyze", "m.py:f", "--html=r.html"])
    assert not entry.cacheable(["gpus"])
    assert not entry.cacheable(["analyze", "--help"])


@pytest.mark.parametrize("platform,env,want", [
    ("linux", {"XDG_CACHE_HOME": "/x/cache"}, "/x/cache/memsim"),
    ("linux", {"HOME": "/home/u"}, "/home/u/.cache/memsim"),
    ("darwin", {"HOME": "/Users/u"}, "/Users/u/Library/Caches/memsim"),
])
def test_cache_location_follows_the_platform(monkeypatch, platform, env, want):
    for k in ("MEMSIM_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(sys, "platform", platform)
    assert entry.cache_dir() == want
    monkeypatch.setenv("MEMSIM_CACHE_DIR", "/elsewhere")
    assert entry.cache_dir() == "/elsewhere"


def test_the_console_script_flushes_and_exits_with_the_commands_code(tmp_path):
    """``memsim.entry.script`` (the installed command) leaves with ``os._exit``: what it printed
    reaches a pipe whole, and the exit code is the command's."""
    def script(*argv):
        code = "import sys\nfrom memsim.entry import script\nsys.argv[1:] = %r\nscript()" % (
            list(argv),)
        env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=env, cwd=tmp_path)

    ok = script("gpus")
    direct = subprocess.run([sys.executable, "-c", "from memsim.entry import main; main(['gpus'])"],
                            capture_output=True, text=True, cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": ROOT})
    assert ok.returncode == 0 and ok.stdout == direct.stdout and "h100" in ok.stdout.lower()
    bad = script("analyze", "missing.py:model", "--input", "x=float32[B,8]", "--no-cache")
    assert bad.returncode == 2 and "no such file: missing.py" in bad.stderr


def test_settle_freezes_the_heap_only_in_the_commands_own_process(monkeypatch):
    """``settle`` (called once the model is built) turns the cycle collector back on over a
    frozen heap in the command's process only; in a caller's process it changes nothing."""
    import gc

    from memsim import process
    assert not process._OWNED and gc.isenabled()
    before = gc.get_freeze_count()
    process.settle()
    assert gc.get_freeze_count() == before and gc.isenabled()
    monkeypatch.setattr(process, "_OWNED", True)
    gc.disable()
    try:
        process.settle()
        assert gc.isenabled() and gc.get_freeze_count() > before
    finally:
        gc.unfreeze()
        gc.enable()
