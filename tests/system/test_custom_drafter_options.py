"""A drafter's own option reaches every front door (issue 42, item 1): the learned head of ``docs/custom_drafter.md``.

The page's ``bigram_head/__init__.py`` block is written to a folder and imported the way the command line
imports an installed drafter (``$SELFSPEC_DRAFTERS``); its one registration declares ``bigram_table``, which
nothing in selfspec names. Then the option is set through ``from_pretrained``, ``selfspec generate
--bigram-table``, ``selfspec serve --bigram-table`` (its flags and engine, answering a chat request),
``ChatSpeculative`` and ``SpeculativeLLM``, and calibration (``drafter="auto"``) and ``selfspec bench`` consider
the head. Everything runs on a tiny random model, without the hub.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from langchain_selfspec import ChatSpeculative  # the adapters' classes are made before the head registers
from llama_index.llms.selfspec import SpeculativeLLM
from tiny_models import make_model
from tiny_tokenizer import make_tokenizer

from selfspec import SpeculativeEngine
from selfspec.cli import build_parser, main
from selfspec.cli.args import engine_kwargs
from selfspec.drafting import unregister_drafter
from selfspec.errors import ConfigurationError

DOC = Path(__file__).resolve().parents[2] / "docs" / "custom_drafter.md"
SECTION = "## A learned head with a file option, from every front door"
PROMPT = "It is a truth universally acknowledged, that a single man"
MAX_NEW_TOKENS = 12


def documented_head() -> str:
    """The page's ``bigram_head/__init__.py``: the first Python block of its section."""
    section = DOC.read_text(encoding="utf-8").split(SECTION, 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, f"no Python block under {SECTION!r}"
    return match.group(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-model")
    tokenizer = make_tokenizer()
    model = make_model("llama", dtype=torch.float32, vocab_size=len(tokenizer), max_position_embeddings=2048)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The documented folder, imported as the command line imports a drafter module, and registered."""
    from selfspec.cli.main import load_drafter_plugins

    root = tmp_path_factory.mktemp("plugins")
    (root / "bigram_head").mkdir()
    (root / "bigram_head" / "__init__.py").write_text(documented_head(), encoding="utf-8")
    patch = pytest.MonkeyPatch()
    patch.syspath_prepend(str(root))
    patch.setenv("SELFSPEC_DRAFTERS", "bigram_head")
    patch.setenv("SELFSPEC_CACHE", str(root / "cache"))
    load_drafter_plugins()
    try:
        yield sys.modules["bigram_head"]
    finally:
        unregister_drafter("bigram_head")
        sys.modules.pop("bigram_head", None)
        patch.undo()


@pytest.fixture(scope="module")
def table(head: Any, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A head trained on the model's own text, in a file of its own."""
    engine = SpeculativeEngine.from_pretrained(model_dir, drafter="none", threads=1)
    return head.train_bigram_head(engine, [PROMPT], path=tmp_path_factory.mktemp("head") / "table.json")


@pytest.fixture(scope="module")
def plain_text(model_dir: Path) -> str:
    engine = SpeculativeEngine.from_pretrained(model_dir, drafter="none", threads=1)
    return engine.generate(PROMPT, max_new_tokens=MAX_NEW_TOKENS).text


def test_from_pretrained_takes_the_option(head: Any, table: Path, model_dir: Path, plain_text: str) -> None:
    engine = SpeculativeEngine.from_pretrained(model_dir, drafter="bigram_head", bigram_table=table, threads=1)
    assert engine.config.bigram_table == table and engine.bigram_table == table
    assert isinstance(engine.drafter, head.BigramHeadDrafter) and engine.drafter.table
    out = engine.generate(PROMPT, max_new_tokens=MAX_NEW_TOKENS)
    assert out.text == plain_text and out.stats.num_accepted > 0  # the learned table drafts what the model writes
    with pytest.raises(TypeError, match="unexpected keyword argument 'bigram_tabel' \\(did you mean 'bigram_table'"):
        SpeculativeEngine.from_pretrained(model_dir, drafter="bigram_head", bigram_tabel=table)
    with pytest.raises(ConfigurationError, match="bigram_table= is only used with drafter='bigram_head'"):
        SpeculativeEngine.from_pretrained(model_dir, drafter="prompt_lookup", bigram_table=table)
    with pytest.raises(ConfigurationError, match="is not a file"):
        SpeculativeEngine.from_pretrained(model_dir, drafter="bigram_head", bigram_table=table.with_name("none.json"))


def test_selfspec_generate_takes_its_flag(
    head: Any, table: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", "--model", str(model_dir), "--raw", "--max-new-tokens", str(MAX_NEW_TOKENS), "--threads", "1"]
    assert main([*argv, "--drafter", "bigram_head", "--bigram-table", str(table), "--stats", PROMPT]) == 0
    printed = capsys.readouterr()
    assert main([*argv, "--drafter", "none", PROMPT]) == 0
    assert printed.out == capsys.readouterr().out and "tau" in printed.err
    assert main([*argv, "--drafter", "bigram_head", "--bigram-table", str(table.with_name("none.json")), PROMPT]) == 2
    assert "is not a file" in capsys.readouterr().err
    assert "--bigram-table" in build_parser()._subparsers._group_actions[0].choices["chat"].format_help()  # type: ignore[union-attr]


def test_selfspec_serve_takes_its_flag(head: Any, table: Path, model_dir: Path) -> None:
    from fastapi.testclient import TestClient

    from selfspec import get_engine
    from selfspec.serving.server import create_app

    args = build_parser().parse_args(["serve", "--model", str(model_dir), "--drafter", "bigram_head",
                                      "--bigram-table", str(table), "--threads", "1"])  # fmt: skip
    kwargs = engine_kwargs(args)  # what cmd_serve loads its engine with
    assert kwargs["bigram_table"] == str(table)
    engine = get_engine(args.model, **kwargs)
    assert isinstance(engine.drafter, head.BigramHeadDrafter) and engine.config.bigram_table == str(table)
    with TestClient(create_app(engine, model_id="tiny"), base_url="http://127.0.0.1") as http:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6}
        answer = http.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] is not None


def test_both_adapters_take_it(head: Any, table: Path, model_dir: Path) -> None:
    """Registered after the adapters' classes were made: the value goes to their ``drafter_settings``."""
    assert "bigram_table" not in ChatSpeculative.model_fields and "bigram_table" not in SpeculativeLLM.model_fields
    common = {"model": str(model_dir), "max_tokens": 6, "threads": 1}
    chat = ChatSpeculative(drafter="bigram_head", bigram_table=str(table), **common)
    assert chat.drafter_settings == {"bigram_table": str(table)}
    assert chat._engine_args()["bigram_table"] == str(table)
    engine = chat.get_engine()
    assert isinstance(engine.drafter, head.BigramHeadDrafter) and engine.config.bigram_table == str(table)
    assert chat.invoke("Hello").content == ChatSpeculative(drafter="none", **common).invoke("Hello").content
    llm = SpeculativeLLM(drafter="bigram_head", drafter_settings={"bigram_table": str(table)}, **common)
    assert isinstance(llm.engine.drafter, head.BigramHeadDrafter) and llm.engine.config.bigram_table == str(table)
    assert llm.complete("Hello").text == SpeculativeLLM(drafter="none", **common).complete("Hello").text


def test_a_drafter_registered_before_the_adapters_gets_a_field_of_its_own(head: Any) -> None:
    script = (
        "import bigram_head\n"
        "from langchain_selfspec import ChatSpeculative\n"
        "from llama_index.llms.selfspec import SpeculativeLLM\n"
        "for adapter in (ChatSpeculative, SpeculativeLLM):\n"
        "    field = adapter.model_fields['bigram_table']\n"
        "    assert field.default is None and 'bigram_head' in field.description, field\n"
        "    assert adapter(drafter='bigram_head', bigram_table='t.json').bigram_table == 't.json'\n"
        "print('ok')\n"
    )
    path = str(Path(head.__file__).parents[1])
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=_env(path))
    assert done.stdout.split() == ["ok"], done.stderr[-2000:]


def _env(path: str) -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": os.pathsep.join([path, os.environ.get("PYTHONPATH", "")])}


def test_calibration_and_bench_consider_the_head(head: Any, table: Path, model_dir: Path) -> None:
    from selfspec.calibration import calibrate
    from selfspec.calibration.bench import run_benchmark

    engine = SpeculativeEngine.from_pretrained(model_dir, drafter="bigram_head", bigram_table=table, threads=1)
    result = calibrate(engine, max_new_tokens=8, max_draft_tokens=4, save=False, progress=False,
                       methods=["bigram_head"])  # fmt: skip
    assert [label for label in result.candidates if label.startswith("bigram_head")]
    # a plan that chose the head records its table: an "auto" engine not given one builds the head with it
    plan = {"method": "bigram_head", "settings": {"options": {}, "num_draft_tokens": 3,
                                                  "drafter_settings": {"bigram_table": str(table)}}}  # fmt: skip
    model, tokenizer = engine.model, engine.tokenizer
    auto = SpeculativeEngine(model, tokenizer, drafter="auto", calibration={**result.to_json(), "plan": plan})
    assert auto.plan.method == "bigram_head" and auto.config.bigram_table == str(table)
    assert SpeculativeEngine(model, tokenizer, drafter="auto", bigram_table=table).config.bigram_table == table
    head.train_bigram_head(engine, [PROMPT])  # saved for the model: selfspec bench adds its row
    report = run_benchmark(str(model_dir), methods=["bigram_head"], categories=["rag"], max_new_tokens=8,
                           repeats=1, temperatures=(), progress=False)  # fmt: skip
    assert report.methods["selfspec_bigram_head"]["identical_to_greedy"] is True
