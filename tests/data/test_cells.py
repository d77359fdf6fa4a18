"""Cells read as the user wrote them: no type guessing, and a row without a usable value dropped and counted."""
import json

import pytest
import torch

from tier_utils import DataError, build_datasets
from tier_utils.data.tokenizer import ByteTokenizer


def pairs(splits) -> list[tuple[str, str]]:
    tok = ByteTokenizer()
    out = []
    for part in (splits.train, splits.val):
        for i in range(len(part)):
            row = part[i]
            out.append((tok.decode(row["input_ids"]), tok.decode(row["labels"][row["labels"] >= 0])))
    return sorted(out)


def test_csv_cells_keep_their_text_and_only_empty_cells_are_missing(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text("input,target\na,0044\nb,None\nc,NA\nd,null\ne,\nf,45\n")
    with pytest.warns(UserWarning, match=r"dropped 1 of 6 rows whose 'target' is missing, empty or not text \(rows 5"):
        splits = build_datasets(path, "seq2seq", seq_len=16, val_fraction=0)
    assert pairs(splits) == [("a", "0044"), ("b", "None"), ("c", "NA"), ("d", "null"), ("f", "45")]


def test_jsonl_nulls_lists_and_dicts_are_dropped_never_trained_as_their_python_text(tmp_path):
    rows = [{"input": "a", "target": "0044"}, {"input": "b", "target": None}, {"input": "c", "target": ["x", "y"]},
            {"input": "d", "target": {"text": "z"}}, {"input": "e", "target": 45}, {"input": None, "target": "q"},
            {"input": "g", "target": "   "}]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.warns(UserWarning) as said:
        splits = build_datasets(path, "seq2seq", seq_len=16, val_fraction=0)
    assert pairs(splits) == [("a", "0044"), ("e", "45")]
    lines = [str(w.message) for w in said]
    assert any("dropped 4 of 7 rows whose 'target'" in line and "rows 2, 3, 4, 7" in line for line in lines)
    assert any("dropped 1 of 7 rows whose 'input'" in line for line in lines)


def test_an_empty_target_is_judged_on_its_own_tokens_before_the_end_token(tmp_path):
    class EndToken(ByteTokenizer):  # T5's rule: every encoded example ends with an end token
        def encode_example(self, text, target=False):
            return torch.cat([self.encode(text), torch.tensor([0])])

    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"input": f"s{i}", "target": "" if i % 3 == 0 else "\u200b" if i == 4 else
                                        f"t{i}"}) + "\n" for i in range(9)))
    with pytest.warns(UserWarning, match="dropped 3 of 9 rows whose 'target'"):
        splits = build_datasets(path, "seq2seq", seq_len=16, val_fraction=0, tokenizer=EndToken())
    assert len(splits.train) == 6  # the zero-width space is text: it has tokens of its own


def test_no_usable_row_is_refused_in_one_line(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text("input,target\na,\nb, \n")
    with pytest.raises(DataError, match="has no usable row: every row's 'target' is missing, empty or not text"):
        build_datasets(path, "seq2seq", seq_len=16)


@pytest.mark.filterwarnings("ignore:.*'translation.de'")  # the null row, said for each language
def test_translation_rows_without_their_languages_are_dropped(tmp_path):
    rows = [{"translation": {"de": "hallo", "en": "hello"}}, {"translation": None}, {"translation": {"de": "ja"}},
            {"translation": {"de": "nein", "en": "no"}}]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    from tier_utils import DataSource
    with pytest.warns(UserWarning, match="dropped 2 of 4 rows whose 'translation.en'"):
        splits = build_datasets(DataSource(str(path), "de", "en"), "seq2seq", seq_len=16, val_fraction=0)
    assert pairs(splits) == [("hallo", "hello"), ("nein", "no")]


@pytest.mark.parametrize("text,needle", [
    ('{"input": "a", "target": "b"}\n["not", "an object"]\n', r"p.jsonl row 2 is a list, not an object"),
    ('{"input": "a", "target": "b"}\n{oops\n', r"p.jsonl line 2 is not JSON"),
    ("", r"p.jsonl has no rows"),
])
def test_bad_jsonl_names_the_file_and_line(tmp_path, text, needle):
    path = tmp_path / "p.jsonl"
    path.write_text(text)
    with pytest.raises(DataError, match=needle):
        build_datasets(path, "seq2seq", seq_len=16)


def test_labels_are_class_ids_as_numbers_and_a_missing_label_drops_its_row(tmp_path):
    path = tmp_path / "c.csv"
    path.write_text("text,label\none,1\nzero,0\nagain one,01\nnone,\nthree,3.0\nzero again,0\n")
    with pytest.warns(UserWarning, match=r"dropped 1 of 6 rows whose 'label'.*\(rows 4\)"):
        splits = build_datasets(path, "classification", seq_len=16, num_classes=4, val_fraction=0)
    labels = sorted(int(splits.train[i]["labels"]) for i in range(len(splits.train)))
    assert labels == [0, 0, 1, 1, 3] and not splits.classes  # whole numbers are ids, "01" is class 1
