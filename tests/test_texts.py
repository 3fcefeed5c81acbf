"""Hub datasets as calibration/evaluation texts (pipeline.texts), from dataset repos written here in
the Hugging Face cache layout and read offline, the way a build server's cache serves them."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.errors import RecipeError, SourceError
from pipeline.recipe import load_recipe
from pipeline.texts import dataset_text, parse_hf_ref
from tests.conftest import empty_checkpoint

SHA = "0123456789abcdef0123456789abcdef01234567"
WIKI_ROWS = ["", " = Title = \n", "", " The first line .\n", " The second line .\n"]
WIKI_CARD = """---
configs:
- config_name: wikitext-2-raw-v1
  data_files:
  - split: test
    path: wikitext-2-raw-v1/test-*
  - split: train
    path: wikitext-2-raw-v1/train-*
---
# a wikitext-like dataset
"""


def write_dataset(hub: Path, repo: str, files: dict[str, list[dict]], card: str | None = None) -> None:
    """A dataset repo at commit SHA in huggingface_hub's cache layout: parquet files, optional card."""
    root = hub / f"datasets--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / SHA
    for rel, rows in files.items():
        (snapshot / rel).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), snapshot / rel)
    if card is not None:
        (snapshot / "README.md").write_text(card)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(SHA)


@pytest.fixture
def offline_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An offline huggingface_hub whose cache is tmp_path/hub (what HF_HUB_CACHE + HF_HUB_OFFLINE set)."""
    from huggingface_hub import constants

    hub = tmp_path / "hub"
    hub.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    return hub


def test_a_card_config_split_and_column_become_one_text_file(offline_hub: Path, tmp_path: Path) -> None:
    write_dataset(
        offline_hub,
        "acme/wiki",
        {
            "wikitext-2-raw-v1/test-00000-of-00001.parquet": [{"text": r} for r in WIKI_ROWS],
            "wikitext-2-raw-v1/train-00000-of-00001.parquet": [{"text": " training only \n"}],
        },
        WIKI_CARD,
    )
    ref = parse_hf_ref(f"hf:acme/wiki@{SHA}:wikitext-2-raw-v1/test")
    path = dataset_text(ref, tmp_path / "cache")
    # wikitext's rows are lines: kept as they are, an empty row is an empty line
    assert path.read_text() == "\n = Title = \n\n The first line .\n The second line .\n"
    assert dataset_text(ref, tmp_path / "cache") == path  # cached: the same file, not re-read


def test_documents_without_a_card_use_the_hub_layout_and_a_named_column(
    offline_hub: Path, tmp_path: Path
) -> None:
    docs = [{"text": "First document.", "meta": "a"}, {"text": "Second document.", "meta": "b"}]
    write_dataset(offline_hub, "acme/pile", {"data/train-00000-of-00001-abc.parquet": docs})
    path = dataset_text(parse_hf_ref(f"hf:acme/pile@{SHA}:default/train:text"), tmp_path / "cache")
    assert path.read_text() == "First document.\n\nSecond document.\n\n"
    meta = dataset_text(parse_hf_ref(f"hf:acme/pile@{SHA}:default/train:meta"), tmp_path / "cache")
    assert meta.read_text() == "a\n\nb\n\n"


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        (
            f"hf:acme/wiki@{SHA}:wikitext-103-raw-v1/test",
            "no config 'wikitext-103-raw-v1' (configs: wikitext-2",
        ),
        (f"hf:acme/wiki@{SHA}:wikitext-2-raw-v1/validation", "no split 'validation' (splits: test, train)"),
        (f"hf:acme/wiki@{SHA}:wikitext-2-raw-v1/test:body", "no column 'body' (columns: text)"),
        ("hf:acme/other@" + SHA + ":default/train", "not in the local HF cache"),
        ("hf:acme/empty@" + SHA + ":default/train", "holds no text"),
        ("hf:acme/nofiles@" + SHA + ":default/test", "no data files for config 'default' split 'test'"),
    ],
)
def test_what_cannot_be_read_is_one_clear_error(
    offline_hub: Path, tmp_path: Path, ref: str, message: str
) -> None:
    write_dataset(
        offline_hub,
        "acme/wiki",
        {
            "wikitext-2-raw-v1/test-00000-of-00001.parquet": [{"text": r} for r in WIKI_ROWS],
            "wikitext-2-raw-v1/train-00000-of-00001.parquet": [{"text": "x\n"}],
        },
        WIKI_CARD,
    )
    write_dataset(offline_hub, "acme/empty", {"data/train-0.parquet": [{"text": ""}, {"text": "  "}]})
    write_dataset(offline_hub, "acme/nofiles", {"data/train-0.parquet": [{"text": "a"}]})
    with pytest.raises(SourceError, match=message.replace("(", r"\(").replace(")", r"\)")):
        dataset_text(parse_hf_ref(ref), tmp_path / "cache")
    assert not list((tmp_path / "cache").rglob("text.txt"))  # nothing half-written is kept


def test_recipes_check_the_reference_form_and_fetch_only_when_building(tmp_path: Path) -> None:
    empty_checkpoint(tmp_path)

    def recipe(evaluation: str) -> Path:
        path = tmp_path / "r.yaml"
        path.write_text(
            yaml.safe_dump(
                {
                    "name": "t",
                    "source": {"path": str(tmp_path)},
                    "evaluation": {"text": evaluation},
                    "smoke": {"prompts": ["hi"]},
                    "targets": {
                        "f16": {
                            "kind": "gguf",
                            "quant": "F16",
                            "gates": {"max_ppl_delta_pct": 1, "max_kld_mean": 1},
                        }
                    },
                }
            )
        )
        return path

    for bad in ("hf:acme/wiki:wikitext/test", f"hf:acme/wiki@{SHA[:12]}:c/test", f"hf:acme/wiki@{SHA}:c"):
        with pytest.raises(RecipeError, match=r"evaluation\.text: .* hf:<repo>@<40-hex commit>"):
            load_recipe(recipe(bad))
    # a well-formed reference loads without the dataset being anywhere yet
    loaded = load_recipe(recipe(f"hf:acme/absent@{SHA}:default/test:sentence"))
    ref = parse_hf_ref(loaded.recipe.evaluation.text)
    assert (ref.repo, ref.revision, ref.config, ref.split, ref.column) == (
        "acme/absent",
        SHA,
        "default",
        "test",
        "sentence",
    )
