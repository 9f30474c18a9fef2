"""Tiny text data for the text recipe's tests, written by the tests themselves (no network), and
copies of the recipe made as README "Make your own recipe" says.

    write_corpus(root, n_train=203, n_test=61)          # root/train|test/<ham|spam>/doc_N.txt
    write_corpus(root, 80, 0, layout="classes")         # root/<ham|spam>/doc_N.txt
    with copied_text(model=RECORDING_MODEL) as copy: ...  # recipes/my_xxxx.py and its files

Every document starts with `id00042 `, its number, then words of its class and of both classes,
some of them bytes that are not UTF-8, up to a length drawn on a log scale: a byte model tells
the classes apart in a few dozen steps. The recording model writes down those numbers.
"""

import contextlib
import json
import uuid

import numpy as np
from conftest import REPO, changed_lines

N_TRAIN, N_TEST = 203, 61  # conftest's text_corpus: odd, no process count used here divides them
# batch_size 8, max_length 1024: batches of at most 8 documents and 8 x 1024 padded tokens.
SETTINGS = ["--batch_size", 8, "--eval_batch_size", 16, "--max_length", 1024]
# The byte CNN (RECORDING_MODEL derives from it: it reads each document's id from its bytes),
# in batches of a token budget (batch_size x max_length) rather than a global batch.
CNN = ["--model", "cnn", "--lr", 3e-3, "--global_batch_size", 0]
CLASSES = ("ham", "spam")
WORDS = {
    "ham": ["meeting", "patch", "kernel", "thanks", "review", "lunch", "build", "release"],
    "spam": ["winner", "free", "money", "viagra", "click", "offer", "cash", "prize"],
}
SHARED = ["the", "a", "to", "of", "and", "mail", "list", "re:", "\xe9t\xe9", "\xff\xfe"]


def document(i, label, length, rng):
    """Document i of class `label`, about `length` bytes: its id, then words (a quarter of
    them the class's own; latin-1, so some bytes are not UTF-8)."""
    words = [f"id{i:05d}"]
    size = len(words[0])
    while size < length:
        pool = WORDS[label] if rng.random() < 0.25 else SHARED
        words.append(pool[rng.integers(len(pool))])
        size += len(words[-1]) + 1
    return " ".join(words).encode("latin-1")[: max(length, 8)]


def documents(n, seed, first_id=0, shortest=16, longest=3000):
    """n (id, class, bytes) of lengths from shortest to longest on a log scale."""
    rng = np.random.default_rng(seed)
    lengths = np.exp(rng.uniform(np.log(shortest), np.log(longest), n)).astype(int)
    labels = rng.integers(0, len(CLASSES), n)
    out = []
    for k in range(n):
        label = CLASSES[labels[k]]
        out.append((first_id + k, label, document(first_id + k, label, lengths[k], rng)))
    return out


def write_corpus(root, n_train, n_test, *, seed=0, layout="split", longest=3000):
    """layout split: root/train/<class>/doc_ID.txt and root/test/<class>/...; classes:
    root/<class>/... (n_train + n_test documents). Returns root."""
    docs = {
        "train": documents(n_train, seed, longest=longest),
        "test": documents(n_test, seed + 1, first_id=n_train, longest=longest),
    }
    for split, items in docs.items():
        for i, label, text in items:
            folder = root / split / label if layout == "split" else root / label
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"doc_{i:05d}.txt").write_bytes(text)
    return root


def batches(ids, nproc):
    """Each process's training batches as RECORDING_MODEL wrote them to the folder `ids`, in
    order: [[document ids, padded length], ...] per process."""
    return [
        [json.loads(line) for line in (ids / f"rank{r}.jsonl").read_text().splitlines()]
        for r in range(nproc)
    ]


# ByteCNN that also writes down the ids of the documents of every training batch, and the
# batch's padded length, a JSON line per batch in $PROBE_OUT/rank{RANK}.jsonl.
RECORDING_MODEL = """
import json
import os


class RecordingCNN(ByteCNN):  # the user's own model, which says what it trains on
    def forward(self, tokens):
        if self.training:
            digits = (tokens[:, 2:7] - 1 - ord("0")).cpu()
            ids = (digits * torch.tensor([10000, 1000, 100, 10, 1])).sum(1).tolist()
            rank = os.environ.get("RANK", "0")
            with open(os.path.join(os.environ["PROBE_OUT"], f"rank{rank}.jsonl"), "a") as f:
                f.write(json.dumps([ids, tokens.shape[1]]) + "\\n")
        return super().forward(tokens)

"""
MODEL_LINE = "        return ByteCNN(vocab, num_classes, width, depth, dropout)"


@contextlib.contextmanager
def copied_text(model=None):
    """recipes/text.py with its serving file copied as README "Make your own recipe" says, under a
    new name my_XXXX, each import marked ADAPT pointed at the copies; with `model` (the source of
    a class deriving from ByteCNN), text_model.py copied too (the training file's import of it
    pointed at the copy), its ByteCNN line building that class. Yields (the recipe's path,
    {file: lines of the original it changed}); deleted on leaving."""
    name = f"my_{uuid.uuid4().hex[:4]}"
    files = ["text", "text_predict"] + (["text_model"] if model else [])
    originals = {f: (REPO / "recipes" / f"{f}.py").read_text() for f in files}
    texts = dict(originals)
    texts["text_predict"] = texts["text_predict"].replace("from text import", f"from {name} import")
    if model:
        texts["text"] = texts["text"].replace("from text_model import", f"from {name}_model import")
        marker = "class Transformer(nn.Module):"
        assert texts["text_model"].count(MODEL_LINE) == 1
        texts["text_model"] = texts["text_model"].replace(marker, model.strip() + "\n\n\n" + marker)
        texts["text_model"] = texts["text_model"].replace(
            MODEL_LINE, MODEL_LINE.replace("return ByteCNN(", "return RecordingCNN(")
        )
    paths = {f: REPO / "recipes" / f"{f.replace('text', name, 1)}.py" for f in files}
    for f, text in texts.items():
        paths[f].write_text(text)
    try:
        yield paths["text"], {f: changed_lines(originals[f], texts[f]) for f in files}
    finally:
        for path in paths.values():
            path.unlink()


def tiny_encoder(folder, texts):
    """A tiny BERT (2 layers of 32) saved with save_pretrained in `folder`, with a WordPiece
    tokenizer trained on `texts` (str): what a hub name gives, made here with no download."""
    import transformers
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer()
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=400, special_tokens=special)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    cls, sep = (tokenizer.token_to_id(t) for t in ("[CLS]", "[SEP]"))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        **dict(zip(["pad_token", "unk_token", "cls_token", "sep_token", "mask_token"], special)),
    )
    fast.save_pretrained(folder)
    config = transformers.BertConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=256,
    )
    transformers.BertModel(config).save_pretrained(folder)
    return folder
