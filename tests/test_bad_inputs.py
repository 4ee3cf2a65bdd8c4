"""Bad input never shows a traceback: one table row per bad input, for every user-facing entry point.

CLI rows run ``autopar.cli.main`` (what the ``autopar`` script calls) in this process and expect
exit code 2 with ``autopar...: error: ...`` on stderr: at most 3 lines, no "Traceback", no torch
log lines. API rows expect an ``AutoparError`` subclass whose message holds the bad value and a
phrase naming the fix, with the original exception chained where one was wrapped, nothing on
stderr, and the model's parameters and buffers bitwise as they were.

A new row is one line in ``CLI_ROWS`` or ``API_ROWS`` (tests/bad_input_rows.py). API rows call ``fn(ctx)``; ``ctx.model``
and ``ctx.inputs`` are a fresh seeded model (the row's ``model``), ``ctx.files`` a folder of bad
files (``ctx.file(name)``), ``ctx.plan_json(name, n)`` a plan made for a zoo model. Rows with
``pg=True`` run inside a 1-rank gloo process group (``autopar.runtime.parallel_module.parallelize`` needs one).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

import autopar
from autopar.errors import AutoparError
from autopar.runtime.parallel_module import parallelize

sys.path.insert(0, os.path.dirname(__file__))
from bad_input_rows import API_ROWS, BAD_FILES, CLI_ROWS, FACTORIES, MODELS, Api, Cli, Ctx  # noqa: E402


# --- the checks -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> str:
    """A folder holding the user's factory package (``autopar_badpkg``) and the bad files."""
    root = tmp_path_factory.mktemp("bad_inputs")
    pkg = root / "autopar_badpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "factories.py").write_text(FACTORIES)
    for name, content in BAD_FILES.items():
        (root / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(root)


@pytest.fixture
def in_files(files, monkeypatch) -> str:
    """Run from the folder of the user's package, as a user runs the CLI; the package is importable
    for the rows' own model building, and forgotten afterwards."""
    monkeypatch.chdir(files)
    monkeypatch.syspath_prepend(files)
    yield files
    for name in [m for m in sys.modules if m == "autopar_badpkg" or m.startswith("autopar_badpkg.")]:
        del sys.modules[name]


@pytest.fixture
def stderr_as_in_a_process(capfd):
    """torch's log handlers write to the object that was ``sys.stderr`` when torch was imported
    (pytest's own capture, here): point them at the captured stderr for the row, as it is in a
    user's process, so that torch's log lines count against the row."""
    import logging

    loggers = [logging.getLogger("torch")] + [lg for name, lg in list(logging.Logger.manager.loggerDict.items())
                                              if name.startswith("torch.") and isinstance(lg, logging.Logger)]
    handlers = {id(h): h for lg in loggers for h in lg.handlers if type(h) is logging.StreamHandler}.values()
    saved = [(h, h.stream) for h in handlers]
    for h, _ in saved:  # (not setStream: it flushes the old stream, which pytest may have closed)
        h.stream = sys.stderr
    yield capfd
    for h, stream in saved:
        h.stream = stream


def _run_cli(argv: list[str]) -> int:
    from autopar.cli import main

    try:
        return main(argv)
    except SystemExit as exc:  # argparse exits
        return exc.code


@pytest.mark.parametrize("row", CLI_ROWS, ids=[r.name for r in CLI_ROWS])
def test_cli_bad_input_is_one_clear_error(row: Cli, in_files, stderr_as_in_a_process):
    capfd = stderr_as_in_a_process
    code = _run_cli(row.argv.format(files=in_files).split())
    out, err = capfd.readouterr()
    lines = err.strip().splitlines()
    assert code == 2, f"exit code {code}; stderr:\n{err}"
    assert "Traceback" not in err and 1 <= len(lines) <= 3, f"{len(lines)} stderr lines:\n{err}"
    assert lines[0].startswith("autopar") and ": error: " in lines[0], err
    assert not any(l[:1] in "EWI" and l[1:5].isdigit() for l in lines), f"torch's log reached stderr:\n{err}"
    assert row.value in err and row.fix in err, f"{row.value!r} or {row.fix!r} not in:\n{err}"


def _state(model: nn.Module) -> dict[str, tuple[torch.Tensor, bool]]:
    tensors = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    return {k: (v.detach().clone(), v.requires_grad) for k, v in tensors.items()}


@pytest.fixture
def process_group(tmp_path):
    """A 1-rank gloo group for the rows that need torch.distributed; gone after the row."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("row", API_ROWS, ids=[r.name for r in API_ROWS])
def test_api_bad_input_raises_a_clear_error_and_changes_nothing(row: Api, in_files, request, stderr_as_in_a_process):
    capfd = stderr_as_in_a_process
    if row.pg:
        request.getfixturevalue("process_group")
    else:
        assert not dist.is_initialized()
    model, inputs = MODELS[row.model]() if row.model else (None, ())
    before = _state(model) if model is not None else {}
    capfd.readouterr()
    with pytest.raises(AutoparError) as info:
        row.fn(Ctx(model, inputs, in_files))
    out, err = capfd.readouterr()
    message = str(info.value)
    assert isinstance(info.value, row.error), f"{type(info.value).__name__}: {message}"
    assert row.value in message and row.fix in message, f"{row.value!r} or {row.fix!r} not in:\n{message}"
    assert err == "", f"stderr not empty (torch's log spilled?):\n{err}"
    if row.cause is not None:
        assert isinstance(info.value.__cause__, row.cause), f"cause {info.value.__cause__!r}"
    if model is not None:  # nothing the user had is changed by a failed call
        after = _state(model)
        assert after.keys() == before.keys()
        for name, (tensor, requires_grad) in before.items():
            now, now_requires_grad = after[name]
            assert now_requires_grad == requires_grad and now.dtype == tensor.dtype and now.shape == tensor.shape
            assert torch.equal(now.view(torch.uint8) if now.numel() else now,
                               tensor.view(torch.uint8) if tensor.numel() else tensor), f"{name} changed"


def test_the_table_covers_every_command_and_has_enough_rows():
    """Every CLI command has a row (a new command must bring its rows), and the table is not thin."""
    from autopar.cli import build_parser

    parser = build_parser()
    commands = set(next(a for a in parser._actions if a.dest == "command").choices)
    covered = {r.argv.split()[0] for r in CLI_ROWS if r.argv}
    assert commands <= covered, f"commands without a bad-input row: {commands - covered}"
    assert len(CLI_ROWS) + len(API_ROWS) >= 25


def test_the_real_script_exits_2_without_a_traceback(files):
    """The issue's own case, through the installed ``autopar`` script in a fresh process: a
    factory module that does not exist."""
    script = os.path.join(os.path.dirname(sys.executable), "autopar")
    cmd = [script] if os.path.exists(script) else [sys.executable, "-m", "autopar"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd + ["plan", "autopar_badpkg.nosuch:build", "--gpus", "8"], cwd=files, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("autopar: error: cannot import module 'autopar_badpkg.nosuch'"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_accepted_edge_cases_still_work(in_files, process_group):
    """World size 1 and one device are not errors: planning for one device gives a one-device
    plan, and parallelize on one rank runs the model as it is."""
    model, inputs = MODELS["mlp"]()
    p = autopar.plan(model, 1, inputs)
    assert p.n_devices == 1 and p.mesh.n_devices == 1
    pm = parallelize(model, example_inputs=inputs)
    torch.testing.assert_close(pm(*inputs), model(*inputs), rtol=0, atol=0)


def test_torch_logs_are_held_only_while_tracing_and_given_back_on_success(capfd):
    """Held records reach the handler they were meant for on release (nothing lost), printed text
    reaches stderr, and the handler is torch's own again afterwards."""
    import io
    import logging

    from autopar.torch_logs import hold_torch_logs

    torch_log, keep = logging.getLogger("torch.export"), logging.StreamHandler(io.StringIO())  # a console handler
    torch_log.addHandler(keep)
    try:
        with hold_torch_logs() as held:
            torch_log.warning("autopar-test: held warning")
            print("autopar-test: held print", file=sys.stderr)
            assert keep.stream.getvalue() == "" and "autopar-test" not in capfd.readouterr().err
        assert "1 warning, 1 printed line" in held.summary() and "held warning" in held.summary()
        held.release()
        assert keep.stream.getvalue() == "autopar-test: held warning\n"
        assert "autopar-test: held print" in capfd.readouterr().err
        torch_log.warning("autopar-test: after")
        assert keep.stream.getvalue().endswith("autopar-test: after\n")
    finally:
        torch_log.removeHandler(keep)
