"""The text recipe's data and input, in this process: every layout that --dataset takes, the split
by content, the one-line errors for bad data, token ids and padding, and models that ignore
padding exactly. test_text.py launches the recipe on such data."""

import json
import math
import os
import sys

import datasets
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from recipe_module import load_recipe
from text_corpus import write_corpus

from common.config import ConfigError, UserError, parse_config
from common.data import DataError
from common.text.data import Documents, TokenSet, check_splits, content_split
from text_data import list_documents
from text_model import (
    COUNTS,
    PAD_MULTIPLE,
    LazyAdamW,
    Tokenizer,
    build_model,
    grams,
    loss_of,
    squared_hinge,
)


@pytest.fixture(scope="module")
def text():
    return load_recipe("text")


def config(text, *args):
    return parse_config(text.Config, [str(a) for a in args])


def test_train_and_test_folders_name_the_classes(text, tmp_path):
    root = write_corpus(tmp_path / ".cache" / "docs", 30, 11)  # under a hidden folder: read
    (root / "train" / "ham" / ".DS_Store").write_bytes(b"\x00")  # hidden files are no documents
    (root / "train" / "ham" / ".git").mkdir()
    (root / "train" / "ham" / ".git" / "HEAD").write_bytes(b"ref")
    train, test, classes, notes = list_documents(config(text, "--dataset", root))
    assert classes == ["ham", "spam"] and (len(train), len(test)) == (30, 11) and notes == []
    assert all(n.endswith(".txt") for n in train.names)
    assert {classes[y] for y in train.labels} == {"ham", "spam"}
    (root / "test" / "eggs").mkdir()
    (root / "test" / "eggs" / "x.txt").write_bytes(b"eggs")
    with pytest.raises(DataError, match=r"test/eggs is a class that .*train does not have"):
        list_documents(config(text, "--dataset", root))


def test_one_folder_per_class_is_split_by_content(text, tmp_path):
    root = write_corpus(tmp_path / "docs", 80, 0, layout="classes")
    twin = next((root / "spam").iterdir()).read_bytes()
    for k in range(5):  # identical documents under other names: all on one side
        (root / "spam" / f"copy_{k}.txt").write_bytes(twin)
    train, test, classes, notes = list_documents(config(text, "--dataset", root))
    assert len(train) + len(test) == 85 and 5 <= len(test) <= 35
    sides = [twin in docs.texts for docs in (train, test)]
    assert sides.count(True) == 1, "identical documents fall on one side"
    assert "held out by a hash of each document's content" in notes[0]
    again = list_documents(config(text, "--dataset", root, "--seed", 7))
    assert again[1].names == test.names, "the split is the same for any seed"


def test_tables_of_every_format_name_their_classes(text, tmp_path):
    rows = [("ham text one", "ham"), ("spam text", "spam"), ("more ham", "ham")]
    features = datasets.Features(
        {"text": datasets.Value("string"), "label": datasets.ClassLabel(names=["ham", "spam"])}
    )
    parquet = tmp_path / "parquet"
    parquet.mkdir()
    for split in ("train", "test"):
        data = {"text": [t for t, _ in rows], "label": [["ham", "spam"].index(y) for _, y in rows]}
        datasets.Dataset.from_dict(data, features=features).to_parquet(parquet / f"{split}.parquet")
    csv_dir = tmp_path / "csv"
    csv_dir.mkdir()
    for split in ("train", "test"):  # labels as names
        lines = ["body,kind"] + [f"{t},{y}" for t, y in rows]
        (csv_dir / f"{split}.csv").write_text("\n".join(lines) + "\n")
    jsonl = tmp_path / "jsonl"
    jsonl.mkdir()  # labels as ints, and no test split: held out by content
    many = [{"text": f"document {i} " + "x" * i, "label": i % 3} for i in range(60)]
    (jsonl / "train.jsonl").write_text("\n".join(json.dumps(r) for r in many) + "\n")

    train, test, classes, _ = list_documents(config(text, "--dataset", parquet))
    assert classes == ["ham", "spam"] and train.labels == [0, 1, 0]
    assert train.texts[0] == b"ham text one" and train.names[0] == "train row 0"
    args = ["--dataset", csv_dir, "--text_column", "body", "--label_column", "kind"]
    train, test, classes, _ = list_documents(config(text, *args))
    assert classes == ["ham", "spam"] and test.labels == [0, 1, 0]
    train, test, classes, notes = list_documents(config(text, "--dataset", jsonl))
    assert classes == ["0", "1", "2"] and len(train) + len(test) == 60 and len(test) > 0
    assert "held out" in notes[0]
    binary = tmp_path / "binary"  # bytes that are not UTF-8, kept as they are
    binary.mkdir()
    emails = {"text": [b"\xff\xfe caf\xe9", b"plain"], "label": ["spam", "ham"]}
    for split in ("train", "test"):
        datasets.Dataset.from_dict(emails).to_parquet(binary / f"{split}.parquet")
    train, _, classes, _ = list_documents(config(text, "--dataset", binary))
    assert train.texts == [b"\xff\xfe caf\xe9", b"plain"] and train.labels == [1, 0]


def test_a_label_at_evaluation_that_training_never_saw_is_one_line(text, tmp_path):
    (tmp_path / "train.csv").write_text("text,label\na,ham\nb,spam\n")
    (tmp_path / "test.csv").write_text("text,label\nc,ham\nd,eggs\n")
    with pytest.raises(DataError, match=r"test row 1 has label 'eggs', which the training split"):
        list_documents(config(text, "--dataset", tmp_path))


def test_bad_documents_are_one_line_errors(text, tmp_path):
    root = write_corpus(tmp_path / "docs", 30, 10)
    lonely = tmp_path / "lonely"  # one folder per class, a class with one document
    write_corpus(lonely, 20, 0, layout="classes")
    (lonely / "eggs").mkdir()
    (lonely / "eggs" / "only.txt").write_bytes(b"one")
    with pytest.raises(DataError, match=r"class eggs \(.*eggs\) has 1 document: a class needs"):
        list_documents(config(text, "--dataset", lonely))
    # A file that cannot be read: a link to nowhere.
    os.symlink(tmp_path / "nowhere", root / "train" / "ham" / "gone.txt")
    with pytest.raises(DataError, match=r"cannot read .*gone.txt \(No such file or directory\)"):
        list_documents(config(text, "--dataset", root))
    with pytest.raises(DataError, match="has no class folders"):
        (tmp_path / "flat").mkdir()
        (tmp_path / "flat" / "a.txt").write_bytes(b"a")
        list_documents(config(text, "--dataset", tmp_path / "flat"))


def test_check_splits_stops_on_empty_documents_and_untrained_classes_and_notes_leaks():
    train = Documents(["a", "b"], [b"x", b"same"], [0, 0])
    test = Documents(["c", "d"], [b"same", b"z"], [0, 1])
    with pytest.raises(DataError, match="class spam has no training document"):
        check_splits(train, test, ["ham", "spam"])
    train.add("e", b"y", 1)
    notes = check_splits(train, test, ["ham", "spam"])
    assert notes == [
        "note: 1 test documents are identical to training documents, which flatters the test "
        "accuracy: hold out by content (one folder per class with val_fraction)"
    ]
    train.add("f", b"", 1)
    with pytest.raises(DataError, match="^f is empty: remove it"):
        check_splits(train, test, ["ham", "spam"])
    kept, held = content_split(train, 0.5)
    assert len(kept) + len(held) == len(train)


def test_a_document_longer_than_a_batch_holds_is_one_line(text, tmp_path):
    root = write_corpus(tmp_path / "docs", 20, 5)
    (root / "train" / "spam" / "huge.txt").write_bytes(b"x" * 300_000)  # a 300 KB message
    accelerator = type("A", (), {"num_processes": 1})()
    # A model whose cost grows with the length (the bag's does not), in batches of a token budget.
    cnn = ["--model", "cnn", "--global_batch_size", 0]
    cfg = config(text, "--dataset", root, "--max_length", 0, "--max_batch_tokens", 100_000, *cnn)
    data = text.load_data(cfg, accelerator)
    assert data.notes[0].startswith("max_length 0: whole documents, up to 300,000 bytes")
    with pytest.raises(
        UserError,
        match=r"max_batch_tokens 100,000 does not hold two of the longest training document, "
        r".*huge.txt \(300,000 bytes, 303,104 padded\): raise it to 606,208, or cut",
    ):
        text.resolved(cfg, data)
    cfg = config(text, "--dataset", root, *cnn)  # max_length 8192: cut, said at start-up
    data = text.load_data(cfg, accelerator)
    assert data.notes[0].startswith("max_length 8,192 bytes: 4.8% of the training documents")
    assert text.resolved(cfg, data).max_batch_tokens == 32 * 8192
    assert data.train_set.lengths.max() == 8192


def test_settings_that_cannot_work_are_refused(text):
    for args, message in [
        (["--model", "rnn"], "model must be bag or cnn or transformer"),
        (["--tokenizer", "bytes"], "model bag reads word n-grams: use --tokenizer words, chars"),
        (["--model", "cnn", "--tokenizer", "words"], "model cnn reads bytes or bpe subwords"),
        (["--model", "cnn", "--tokenizer", "chars"], "model cnn reads bytes or bpe subwords"),
        (["--model", "transformer", "--max_length", 0], "attends over every pair"),
        (["--global_batch_size", 64, "--max_batch_tokens", 4096], "set one"),
        (["--global_batch_size", 0, "--batch_size", 1], "batch_size must be at least 2"),
        (["--val_fraction", 1], "val_fraction must be in"),
    ]:
        with pytest.raises(ConfigError, match=message):
            config(text, *args)


def test_token_ids_are_bytes_plus_one_padded_to_a_multiple():
    tokenizer = Tokenizer("bytes", 5)
    tokens = tokenizer.encode([b"\x00\xffabcdef", b"z"])
    assert tokens[0].tolist() == [1, 256, 98, 99, 100] and tokens[1].tolist() == [123]
    assert len(tokenizer.encode([b"abcdefgh"], whole=True)[0]) == 8
    documents = TokenSet(tokens, [1, 0], ["a", "b"], PAD_MULTIPLE)
    x, y = documents.__getitems__([1, 0])
    assert x.shape == (2, PAD_MULTIPLE) and y.tolist() == [0, 1]
    assert x[0, :2].tolist() == [123, 0] and (x[1, 5:] == 0).all()


def test_word_ids_are_each_known_ngram_once_with_its_count():
    # The vocabulary: the 1-2 grams of 2 training documents or more, the most frequent first
    # (ties by their bytes), from each document's first max_length bytes.
    settings = {"model": "bag", "tokenizer": "auto", "vocab_size": 0, "max_length": 12}
    texts = [b"The cat, the cat.", b"the cat sat", b"a dog"]
    tokenizer = Tokenizer.trained(settings, texts, [0, 1, 1], 2)
    assert list(tokenizer.index) == [b"cat", b"the", b"the cat"] and tokenizer.df == [2, 2, 2]
    [ids] = tokenizer.encode([b"THE CAT the cat dog"], whole=True)  # dog, cat the: not known
    assert ids.tolist() == [2 * COUNTS + 2, 1 * COUNTS + 2, 3 * COUNTS + 2]
    idf = tokenizer.idf()
    assert idf[0] == 0 and torch.allclose(idf[1:], torch.log(torch.tensor(4 / 3)) + 1)
    again = Tokenizer.from_record(tokenizer.record(), 12)  # as the weights file rebuilds it
    assert (
        again.encode([b"the cat, the"])[0].tolist()
        == tokenizer.encode([b"the cat, the"])[0].tolist()
    )
    assert tokenizer.encode([b"cat " * 100], whole=True)[0].tolist() == [COUNTS + 100]
    cut = [COUNTS + 2, 2 * COUNTS + 1, 3 * COUNTS + 1]  # of "cat the cat ", its first 12 bytes
    assert tokenizer.encode([b"cat the cat the"])[0].tolist() == cut
    assert tokenizer.encode([b"cat " * 300], whole=True)[0].tolist() == [COUNTS + COUNTS - 1]


def test_the_bags_ratios_are_naive_bayes_log_count_ratios_of_each_class():
    # NBSVM's ratio of an n-gram for a class: ln((p / |p|) / (q / |q|)), p = 1 + the class's
    # training documents that hold it, q = 1 + the other classes', |.| the sums over the
    # vocabulary; the bag scales the n-gram's weight for the class by it.
    settings = {"model": "bag", "tokenizer": "auto", "vocab_size": 0, "max_length": 0}
    texts = [b"buy now", b"buy cheap now", b"buy", b"meet now", b"meet", b"cheap lunch"]
    tokenizer = Tokenizer.trained(settings, texts, [0, 0, 0, 1, 1, 2], 3)
    assert list(tokenizer.index) == [b"buy", b"now", b"cheap", b"meet"]  # in 2 documents
    assert tokenizer.class_df == [[3, 2, 1, 0], [0, 1, 0, 2], [0, 0, 1, 0]]
    ratios = tokenizer.log_count_ratios(3)
    assert ratios.shape == (5, 3) and (ratios[0] == 0).all()  # padding's row
    p, q = [4, 3, 2, 1], [1, 2, 2, 3]  # class 0: its documents + 1, the others' + 1
    expected = [math.log((a / sum(p)) / (b / sum(q))) for a, b in zip(p, q)]
    assert torch.allclose(ratios[1:, 0], torch.tensor(expected)), ratios[1:, 0]
    assert ratios[1, 0] > 0 > ratios[1, 1] and ratios[4, 1] > 0 > ratios[4, 0]  # buy, meet
    net = build_model({**settings, "width": 64, "depth": 2, "dropout": 0.1}, 3, tokenizer)
    assert net.embed.weight.shape == (5, 3) and torch.equal(net.ratios, ratios)
    again = Tokenizer.from_record(tokenizer.record(), 0)  # as the weights file rebuilds it
    assert torch.equal(again.log_count_ratios(3), ratios)
    vocabulary = json.loads(tokenizer.record()["json"])
    del vocabulary["words"]  # a weights file of the bag before the parts of words
    with pytest.raises(UserError, match="^this bag was trained by an earlier version .* again$"):
        Tokenizer.from_record({"kind": "words", "json": json.dumps(vocabulary)}, 0)


def test_the_bag_learns_by_a_linear_svms_loss_from_words_and_their_parts():
    # LinearSVC's squared hinge, each class against the rest, by hand; cross-entropy elsewhere.
    scores, labels = torch.tensor([[2.0, 0.5, -0.2], [0.3, -3.0, 0.9]]), torch.tensor([0, 2])
    by_hand = [0 + 1.5**2 + 0.8**2, 1.3**2 + 0 + 0.1**2]
    each = squared_hinge(scores, labels, reduction="none")
    assert torch.allclose(each, torch.tensor(by_hand)), each
    assert torch.isclose(squared_hinge(scores, labels), torch.tensor(by_hand).mean())
    assert loss_of("bag") is squared_hinge and loss_of("cnn") is F.cross_entropy
    # A word with ' _ . - inside is also its parts, as 1-grams, after the 1-2 grams.
    assert grams(b"x = np.linalg.norm(v)") == [
        *(b"x", b"=", b"np.linalg.norm", b"(", b"v", b")"),
        *(b"x =", b"= np.linalg.norm", b"np.linalg.norm (", b"( v", b"v )"),
        *(b"np", b"linalg", b"norm"),
    ]


def test_chars_adds_the_byte_grams_of_each_word_that_an_unseen_word_shares():
    # After the words' grams: each distinct word of 2 bytes or more within < and >, its byte
    # 2-4 grams, each marked by #, so that none is a word's.
    assert grams(b"ab c ab", chars=True) == [
        *(b"ab", b"c", b"ab", b"ab c", b"c ab"),
        *(b"#<a", b"#ab", b"#b>", b"#<ab", b"#ab>", b"#<ab>"),
    ]
    settings = {"model": "bag", "tokenizer": "chars", "vocab_size": 0, "max_length": 0}
    texts = [b"Katze und Hund", b"die Katze", b"le chat et le chien", b"un chat"]
    tokenizer = Tokenizer.trained(settings, texts, [0, 0, 1, 1], 2)
    assert tokenizer.kind == "chars" and b"katze" in tokenizer.index and b"#atz" in tokenizer.index
    [ids] = tokenizer.encode([b"Katzen"])  # a word of no training document
    known = {g for g, i in tokenizer.index.items() if i in set(ids // COUNTS)}
    assert known == {  # those of katze (2 documents), and n> of chien and un
        *(b"#<k", b"#ka", b"#at", b"#tz", b"#ze", b"#n>"),
        *(b"#<ka", b"#kat", b"#atz", b"#tze", b"#<kat", b"#katz", b"#atze"),
    }
    words = Tokenizer.trained({**settings, "tokenizer": "words"}, texts, [0, 0, 1, 1], 2)
    assert words.encode([b"Katzen"])[0].size == 0  # words alone know nothing of it
    again = Tokenizer.from_record(tokenizer.record(), 0)  # as the weights file rebuilds it
    assert again.kind == "chars" and again.encode([b"Katzen"])[0].tolist() == ids.tolist()


def test_lazy_adamw_is_adamw_and_on_an_embedding_sparse_adam():
    # A group that is not lazy steps as torch's AdamW; a lazy one (the bag's embedding table)
    # as SparseAdam on the rows that the step's gradient holds, the others left as they are.
    torch.manual_seed(0)
    dense, embedding = torch.randn(5, 3), torch.randn(6, 3)
    ours = [torch.nn.Parameter(t.clone()) for t in (dense, embedding)]
    torchs = [torch.nn.Parameter(t.clone()) for t in (dense, embedding)]
    groups = [{"params": [ours[0]]}, {"params": [ours[1]], "lazy": True, "weight_decay": 0}]
    lazy = LazyAdamW(groups, lr=0.01, weight_decay=0.01)  # SparseAdam has no weight decay
    adamw = torch.optim.AdamW([torchs[0]], lr=0.01, weight_decay=0.01)
    sparse = torch.optim.SparseAdam([torchs[1]], lr=0.01)
    for rows in ([1, 4], [2], [1, 2, 5]):
        g, h = torch.randn(5, 3), torch.zeros(6, 3)
        h[rows] = torch.randn(len(rows), 3)
        ours[0].grad, ours[1].grad = g.clone(), h.clone()
        torchs[0].grad, torchs[1].grad = g.clone(), h.to_sparse()
        for optimizer in (lazy, adamw, sparse):
            optimizer.step()
    assert torch.allclose(ours[0], torchs[0], atol=1e-6) and torch.allclose(
        ours[1], torchs[1], atol=1e-6
    )
    assert torch.equal(ours[1][[0, 3]], embedding[[0, 3]]), "rows no step held stay as they were"


@pytest.mark.parametrize("model", ["bag", "cnn", "transformer"])
def test_a_document_gets_the_same_logits_alone_and_in_a_padded_batch(model):
    settings = {"model": model, "tokenizer": "auto", "vocab_size": 0, "max_length": 512}
    settings.update(width=32, depth=2, dropout=0.0)
    rng = np.random.default_rng(0)
    words = [b"w%d" % i for i in range(50)]
    texts = [b" ".join(rng.choice(words, n)) for n in (37, 300, 5, 512)]
    tokenizer = Tokenizer.trained(settings, texts * 2, [0, 1, 2, 0] * 2, 3)
    net = build_model(settings, 3, tokenizer).eval()
    if model == "bag":  # its weights start at 0: every logit would be the bias
        torch.nn.init.normal_(net.embed.weight)
    documents = TokenSet(tokenizer.encode(texts), [0] * 4, texts, PAD_MULTIPLE)
    with torch.no_grad():
        batch = net(documents.__getitems__([0, 1, 2, 3])[0])
        alone = torch.cat([net(documents.__getitems__([i])[0]) for i in range(4)])
    assert torch.allclose(batch, alone, atol=1e-5), (batch - alone).abs().max()


def test_a_hub_name_without_internet_and_a_missing_package_are_one_line(text, monkeypatch):
    # conftest points the hub at a closed port: the name cannot be loaded, and says what works.
    with pytest.raises(DataError, match=r"could not load 'someone/emails'.*point --dataset"):
        list_documents(config(text, "--dataset", "someone/emails"))
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if it were not installed
    settings = {"model": "cnn", "tokenizer": "bpe", "vocab_size": 400, "max_length": 64}
    with pytest.raises(UserError, match="^tokenizer bpe needs the tokenizers package: pip"):
        Tokenizer.trained(settings, [b"some text"])
