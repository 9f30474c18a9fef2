"""The text recipe's models and input, which recipes/text.py builds from its Config; a copy with
its own model changes this file.

Bag, the default: NBSVM (Wang and Manning 2012, "Baselines and Bigrams"), a linear SVM of
TF-IDF's features scaled by naive-Bayes ratios, trained by the recipe's loop as fastText trains
its bag (Joulin et al. 2017): each word 1-2 gram of a document once, weighted by (1 + ln count) x
idf, its weights scaled to unit length; a class's score is the sum of the n-grams' weights for
that class, each times the n-gram's naive-Bayes log-count ratio for the class; the loss is the
linear SVM's (squared hinge, each class against the rest: squared_hinge()). It reads the words
tokenizer's ids.

ByteCNN: an embedding of each token, two convolutions with a max pool between them, and the
maximum of each channel over the document's positions.

Transformer: a small pre-norm encoder; on bytes it reads `patch` bytes per position (a strided
convolution), so that a document of 8,192 bytes is 1,024 positions.

PretrainedEncoder: a Hugging Face encoder by name or folder (AutoModelForSequenceClassification,
the `transformers` package), fine-tuned, with its own tokenizer.

All ignore padding exactly: the logits of a document are the same alone and in a padded batch
(token 0 is padding, never a byte, a subword or an n-gram), so bucketed and padded batches,
evaluation and predict agree. The input: `Tokenizer` turns documents (bytes) into token ids:
word 1-2 grams of a vocabulary made from the training split, for the bag; raw bytes, or
subwords of a BPE vocabulary trained on the training split (the `tokenizers` package), for the
CNN and the transformer; or the pretrained encoder's own. The weights file records it.
"""

import importlib
import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from common.config import UserError, require
from common.data import looks_like_path

# ADAPT: your model: the Config fields that build it and its input, recorded in the weights file
# so that predict and export rebuild both without flags.
MODEL_SETTINGS = ("model", "pretrained", "tokenizer", "vocab_size", "max_length", "width", "depth")
MODEL_SETTINGS += ("dropout",)
MODELS = ("bag", "cnn", "transformer", "pretrained")
TOKENIZERS = ("auto", "words", "chars", "bytes", "bpe")  # auto: words for the bag, else bytes
# lr 0 takes the model's: the bag's and the CNN's measured (docs/text.md); the pretrained
# encoder's the usual rate for fine-tuning one.
LEARNING_RATES = {"bag": 3e-2, "cnn": 2e-3, "transformer": 2e-3, "pretrained": 5e-5}
# The bag's loss is a linear SVM's, the others' cross-entropy (loss_of); its outputs are scores.
SCORES = ("bag",)
SUBWORDS = 8000  # bpe with vocab_size 0
MOST_GRAMS = 1_000_000  # words with vocab_size 0: the n-grams of 2 training documents or more
# The words tokenizer's ids: an n-gram's number x COUNTS + its count in the document (at most
# COUNTS - 1), each n-gram of a document once; 0 (no n-gram, no count) is padding.
COUNTS = 256
PATCH = 8  # transformer on bytes: bytes per position
PAD = 0  # the padding token
# Batches are padded to a multiple of this many tokens: a transformer's patches come out whole
# (alone or in a batch), and the ONNX graph's length axis is PAD_MULTIPLE x blocks (export).
PAD_MULTIPLE = 16


def check_model_settings(cfg):
    """The one-line errors of the model's settings, as the recipe's Config checks them."""
    require(cfg.model in MODELS, f"model must be {' or '.join(MODELS)}, got {cfg.model!r}")
    require(
        cfg.tokenizer in TOKENIZERS,
        f"tokenizer must be {' or '.join(TOKENIZERS)}, got {cfg.tokenizer!r}",
    )
    words = tokenizer_of(vars(cfg)) in GRAMS
    require(
        (cfg.model == "bag") == words or cfg.model == "pretrained",
        f"model {cfg.model} reads "
        + (
            "word n-grams: use --tokenizer words, chars or auto"
            if cfg.model == "bag"
            else "bytes or bpe subwords, not word n-grams: use --tokenizer bytes, bpe or auto"
        ),
    )
    require(cfg.width >= 8 and cfg.depth >= 1, "width must be at least 8 and depth at least 1")
    require(0 <= cfg.dropout < 1, f"dropout must be in [0, 1), got {cfg.dropout}")
    require(
        cfg.max_length >= 0, f"max_length must be 0 (whole documents) or more, got {cfg.max_length}"
    )
    require(
        cfg.model != "transformer" or cfg.max_length,
        "the transformer attends over every pair of positions: set max_length (e.g. 8192)",
    )
    require(
        cfg.model != "transformer" or cfg.width % 32 == 0,
        f"the transformer's width must be a multiple of 32 (heads of 32), got {cfg.width}",
    )
    require(
        cfg.tokenizer != "bpe" or cfg.vocab_size >= 300 or not cfg.vocab_size,
        f"vocab_size must be at least 300 for bpe (256 bytes and merges), got {cfg.vocab_size}",
    )
    require(
        cfg.vocab_size >= 0,
        f"vocab_size must be 0 (the tokenizer's own) or more, got {cfg.vocab_size}",
    )
    require(
        (cfg.model == "pretrained") == bool(cfg.pretrained),
        "model pretrained fine-tunes the encoder that --pretrained names (a hub name or a "
        "folder): give both, or neither",
    )


def tokenizer_of(settings):
    """The input that `settings` name: tokenizer auto is words for the bag, bytes otherwise."""
    if settings["tokenizer"] != "auto":
        return settings["tokenizer"]
    return "words" if settings["model"] == "bag" else "bytes"


def learning_rate(cfg):
    """cfg.lr, or with lr 0 the model's (LEARNING_RATES)."""
    return cfg.lr or LEARNING_RATES[cfg.model]


# ADAPT: your loss: (logits [N, classes], labels [N], reduction) -> the loss, as F.cross_entropy.
def loss_of(model):
    """The loss that trains `model` (a Config's model name) and that evaluation reports: the
    bag's squared_hinge, else cross-entropy."""
    return squared_hinge if model in SCORES else F.cross_entropy


def squared_hinge(scores, labels, reduction="mean"):
    """A linear SVM's loss (scikit-learn's LinearSVC), each class against the rest: for each
    document the sum over the classes of max(0, 1 - t x score)^2, t +1 for its class and -1 for
    the others. No push on a document whose scores are past the margin: measured against
    cross-entropy on the manual pages and the Python sources (docs/text.md), a point better."""
    t = F.one_hot(labels, scores.shape[1]).to(scores.dtype) * 2 - 1
    loss = (1 - t * scores).clamp(min=0).pow(2).sum(1)
    return loss.mean() if reduction == "mean" else loss


def build_model(settings, num_classes, tokenizer, encoder=None):
    """The model that `settings` (MODEL_SETTINGS) describe, with an output per class, reading
    what `tokenizer` makes. encoder: a pretrained encoder's configuration (JSON,
    encoder_config()) to build it from, with no download (predict, export); None: model
    pretrained loads it and its weights by name."""
    width, depth, dropout = settings["width"], settings["depth"], settings["dropout"]
    if settings["model"] == "bag":
        return Bag(tokenizer.idf(), tokenizer.log_count_ratios(num_classes))
    vocab = Tokenizer.vocab_of(settings)
    if settings["model"] == "cnn":
        return ByteCNN(vocab, num_classes, width, depth, dropout)
    if settings["model"] == "pretrained":
        return PretrainedEncoder(
            settings["pretrained"], num_classes, settings["max_length"], encoder
        )
    patch = PATCH if tokenizer_of(settings) == "bytes" else 1
    positions = -(-settings["max_length"] // PAD_MULTIPLE) * PAD_MULTIPLE // patch
    return Transformer(vocab, num_classes, width, depth, dropout, positions, patch)


def lengths_of(tokens):
    """The real length of each row of a padded batch of token ids [N, L]."""
    return (tokens != PAD).sum(1)


def within(lengths, size):
    """[N, size] True at each row's positions below its length."""
    return torch.arange(size, device=lengths.device) < lengths[:, None]


class Bag(nn.Module):
    """Each n-gram of a document (the words tokenizer's ids) weighted by (1 + ln count) x idf, the
    weights scaled to unit length (L2), as TF-IDF weighs them. Each n-gram has a weight for each
    class (a table, starting at 0), which its log-count ratio for the class scales (fixed, from
    the training split's counts: see Tokenizer.log_count_ratios); a class's score is the sum of
    the scaled weights times the n-grams' TF-IDF weights, plus a bias, trained by squared_hinge
    (a score, not a logit of cross-entropy: predict writes it as it is). The scale is NBSVM's:
    an n-gram that the naive-Bayes counts call telling for a class moves its score by more.
    Padding weighs 0 (its idf and ratio are 0). Its cost grows with the document's distinct
    n-grams, not its length."""

    def __init__(self, idf, ratios):
        super().__init__()
        self.register_buffer("idf", idf, persistent=False)  # the tokenizer's: not weights
        self.register_buffer("ratios", ratios, persistent=False)  # [n-grams, classes]
        self.embed = nn.Embedding(*ratios.shape, padding_idx=PAD)
        nn.init.zeros_(self.embed.weight)
        self.bias = nn.Parameter(torch.zeros(ratios.shape[1]))

    def forward(self, tokens):
        grams, counts = tokens // COUNTS, tokens % COUNTS
        w = (1 + torch.log(counts.clamp(min=1).float())) * self.idf[grams]  # [N, L]
        w = w / w.norm(dim=1, keepdim=True).clamp(min=1e-12)
        scaled = self.embed(grams) * self.ratios[grams]  # [N, L, classes]
        return (scaled * w[..., None]).sum(1) + self.bias  # scores

    def parameter_groups(self):
        """For LazyAdamW: the n-grams' table lazy (a row moves in the steps that see it)."""
        return [{"params": [self.embed.weight], "lazy": True}, {"params": [self.bias]}]


class LazyAdamW(torch.optim.Optimizer):
    """AdamW whose groups marked `lazy` (the bag's table of n-grams) move a row, and decay its
    moments, only in the steps whose documents hold it: lazy Adam, as torch's SparseAdam and
    fastText update, on dense gradients, which DDP reduces on every backend (sparse gradients:
    gloo only). AdamW would go on moving an n-gram that a step does not see by its momentum.
    The other groups: AdamW's update."""

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, {**defaults, "lazy": False})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(
                        step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p)
                    )
                state["step"] += 1
                m, v = state["exp_avg"], state["exp_avg_sq"]
                if not group["lazy"]:
                    adamw(p, p.grad, m, v, state["step"], group)
                    continue
                # The rows that the step's documents hold (the same on every process: the
                # gradients are reduced); the others keep their weights and moments.
                rows = p.grad.abs().sum(1).nonzero()[:, 0]
                w, m_rows, v_rows = p[rows], m[rows], v[rows]
                adamw(w, p.grad[rows], m_rows, v_rows, state["step"], group)
                p[rows], m[rows], v[rows] = w, m_rows, v_rows
        return loss


def adamw(w, g, m, v, t, group):
    """AdamW's update of the weights w with their gradient g and moments m, v, in place, at
    step t (torch.optim.AdamW's arithmetic)."""
    (beta1, beta2), lr = group["betas"], group["lr"]
    w.mul_(1 - lr * group["weight_decay"])
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (v / (1 - beta2**t)).sqrt_().add_(group["eps"])
    w.addcdiv_(m, denom, value=-lr / (1 - beta1**t))


class ByteCNN(nn.Module):
    """Embedding, `depth` convolutions of `width` channels (kernel 5, ReLU; a max pool of 4 after
    each but the last), the maximum over positions, and a linear layer. What lies past a
    document's end is zero after every convolution, as a document alone would have it."""

    def __init__(self, vocab, num_classes, width=64, depth=2, dropout=0.1):
        super().__init__()
        self.embed = nn.Embedding(vocab, width, padding_idx=PAD)
        self.convs = nn.ModuleList(nn.Conv1d(width, width, 5, padding=2) for _ in range(depth))
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(width, num_classes)

    def forward(self, tokens):
        lengths = lengths_of(tokens)
        h = self.embed(tokens).transpose(1, 2)  # [N, width, L]
        for i, conv in enumerate(self.convs):
            h = F.relu(conv(h)) * within(lengths, h.shape[2])[:, None]
            if i < len(self.convs) - 1:
                # The zeros past the end change no maximum: the values are >= 0 after ReLU. 2d:
                # max_pool1d's export to ONNX takes the length for a constant.
                h = F.max_pool2d(F.pad(h, (0, 3))[:, :, None], (1, 4))[:, :, 0]
                lengths = -(-lengths // 4)
        return self.head(self.dropout(h.amax(2)))  # logits


class EncoderLayer(nn.Module):
    """A pre-norm Transformer encoder layer: self-attention over the valid positions (heads of 32
    dimensions), then a feed-forward block of twice the width, each added to its input."""

    def __init__(self, width, dropout):
        super().__init__()
        self.heads = width // 32
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.ff = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.dropout = nn.Dropout(dropout)

    def forward(self, h, valid):
        n, positions, width = h.shape
        qkv = self.qkv(self.norm1(h)).view(n, positions, 3, self.heads, width // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [N, heads, positions, 32]
        p = self.dropout.p if self.training else 0.0
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None], dropout_p=p)
        h = h + self.dropout(self.out(a.transpose(1, 2).reshape(n, positions, width)))
        return h + self.dropout(self.ff(self.norm2(h)))


class Transformer(nn.Module):
    """A pre-norm Transformer encoder of `depth` layers over positions of `patch` tokens each (a
    strided convolution of their embeddings; 1: a position per token), with learned position
    embeddings, and the mean over the document's positions."""

    def __init__(self, vocab, num_classes, width, depth, dropout, positions, patch):
        super().__init__()
        self.patch = patch
        self.embed = nn.Embedding(vocab, width if patch == 1 else 32, padding_idx=PAD)
        self.stem = nn.Conv1d(32, width, patch, stride=patch) if patch > 1 else nn.Identity()
        self.positions = nn.Parameter(torch.randn(positions, width) * 0.02)
        self.layers = nn.ModuleList(EncoderLayer(width, dropout) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, tokens):
        lengths = -(-lengths_of(tokens) // self.patch)
        h = self.embed(tokens)  # whole patches: the length is a multiple of PAD_MULTIPLE
        if self.patch > 1:
            h = self.stem(h.transpose(1, 2)).transpose(1, 2)  # [N, positions, width]
        h = h + self.positions[: h.shape[1]]
        valid = within(lengths, h.shape[1])
        for layer in self.layers:
            h = layer(h, valid)
        h = self.norm(h) * valid[..., None]
        return self.head(h.sum(1) / lengths[:, None].clamp(min=1))  # logits


class PretrainedEncoder(nn.Module):
    """A Hugging Face encoder with a classification head of `num_classes` outputs
    (AutoModelForSequenceClassification), from its name or folder with its pretrained weights,
    or from `config` (its JSON) alone. It takes the recipe's token ids: its own ids plus 1,
    0 for padding, which its attention mask leaves out."""

    def __init__(self, name, num_classes, max_length, config=None):
        super().__init__()
        transformers = _package("transformers", "model pretrained")
        transformers.logging.set_verbosity_error()  # not its table of the head's new weights
        auto = transformers.AutoModelForSequenceClassification
        if config is None:
            self.net = from_pretrained(auto, name, "the encoder", num_labels=num_classes)
        else:
            settings = transformers.AutoConfig.for_model(**json.loads(config))
            self.net = auto.from_config(settings)
        positions = getattr(self.net.config, "max_position_embeddings", None)
        if positions and max_length > positions or not max_length:
            raise UserError(
                f"max_length {max_length} does not fit the encoder {name!r}, which reads "
                f"{positions} positions: set --max_length {positions} (or less)"
            )

    def forward(self, tokens):
        mask = tokens != PAD
        return self.net(input_ids=(tokens - 1).clamp(min=0), attention_mask=mask.long()).logits


def from_pretrained(auto, name, what, **kwargs):
    """auto.from_pretrained(name): a hub name or a folder; one line if it cannot be loaded."""
    if looks_like_path(name) and not Path(name).exists():
        raise UserError(
            f"pretrained {name} does not exist: give a folder that save_pretrained wrote, or a "
            f"hub name"
        )
    try:
        return auto.from_pretrained(name, **kwargs)
    except OSError as e:
        raise UserError(
            f"cannot load {what} of {name!r} ({str(e).splitlines()[0]}): give a hub name (with "
            f"internet) or a folder that save_pretrained wrote"
        ) from None


def encoder_config(model):
    """A PretrainedEncoder's configuration as JSON, for the weights file's record (build_model
    rebuilds it from there); None for the recipe's own models."""
    return model.net.config.to_json_string() if isinstance(model, PretrainedEncoder) else None


# ADAPT: your input: documents (bytes) -> token ids, the same in training, predict and export.
class Tokenizer:
    """Documents as token ids, cut at max_length (0: whole). words: the word 1-2 grams (grams())
    of the document's first max_length bytes that a vocabulary made from the training documents
    holds (trained(): those of 2 documents or more, at most vocab_size, the most frequent), each
    once with its count (COUNTS); the vocabulary's document counts in each class give the idf
    and the bag's log-count ratios. chars: as words, and the words' byte 2-4 grams too.
    bytes: byte b is token b + 1 (any encoding, no vocabulary). bpe: a byte-pair vocabulary of
    vocab_size subwords trained on the training documents, over their bytes read as latin-1 (a
    character per byte, so nothing is undecodable). pretrained: the encoder's own tokenizer,
    over the text read as UTF-8 (bytes that are not: U+FFFD), its ids plus 1. bytes, bpe and
    pretrained cut at max_length tokens. record() keeps what rebuilds it in the weights file
    (from_record())."""

    def __init__(self, kind, max_length, subwords=None, vocabulary=None):
        self.kind, self.max_length, self.subwords = kind, max_length, subwords
        # As made or read: to_str() of a tokenizer read back need not give the same text.
        self.json = subwords.to_str() if subwords is not None else None
        if vocabulary is not None:  # words: {"documents": N, "grams": [...], "class_df": [...]}
            self.json = json.dumps(vocabulary)
            require(
                vocabulary.get("words") == GRAMS[kind],
                "this bag was trained by an earlier version of the recipe (its vocabulary has "
                "other words or no counts by class): train it again",
            )
            self.documents, self.class_df = vocabulary["documents"], vocabulary["class_df"]
            self.df = [sum(counts) for counts in zip(*self.class_df)]  # documents of all classes
            grams = (g.encode("latin-1") for g in vocabulary["grams"])
            self.index = {g: i for i, g in enumerate(grams, 1)}  # 0: padding

    @staticmethod
    def vocab_of(settings):
        return 257 if tokenizer_of(settings) == "bytes" else settings["vocab_size"] or SUBWORDS

    def idf(self):
        """words: each n-gram's idf as scikit-learn smooths it, ln((1 + N) / (1 + df)) + 1;
        padding's 0."""
        df = torch.tensor([0, *self.df], dtype=torch.float64)
        idf = torch.log((1 + self.documents) / (1 + df)) + 1
        idf[PAD] = 0
        return idf.float()

    def log_count_ratios(self, num_classes):
        """words: each n-gram's naive-Bayes log-count ratio for each class, as NBSVM has it:
        ln((p / |p|) / (q / |q|)), p its training documents of the class + 1, q those of the
        other classes + 1, |p| and |q| their sums over the vocabulary; padding's 0.
        [n-grams + 1, num_classes]"""
        n = torch.tensor(self.class_df, dtype=torch.float64).T  # [n-grams, classes]
        require(n.shape[1] == num_classes, "the vocabulary's classes are not the model's")
        p, q = 1 + n, 1 + n.sum(1, keepdim=True) - n
        ratios = torch.log(p / p.sum(0)) - torch.log(q / q.sum(0))
        return torch.cat([torch.zeros(1, num_classes, dtype=torch.float64), ratios]).float()

    @classmethod
    def trained(cls, settings, texts, labels=(), num_classes=0):
        """The tokenizer that `settings` name; words and bpe: made from `texts`; words also
        count each n-gram's documents of each class (`labels`: a class index a text)."""
        if settings["model"] == "pretrained":
            transformers = _package("transformers", "model pretrained")
            name = settings["pretrained"]
            tokenizer = from_pretrained(transformers.AutoTokenizer, name, "the tokenizer")
            return cls("pretrained", settings["max_length"], tokenizer.backend_tokenizer)
        kind, max_length = tokenizer_of(settings), settings["max_length"]
        if kind == "bytes":
            return cls("bytes", max_length)
        if kind in GRAMS:
            cut, chars = slice(max_length or None), kind == "chars"
            by_class = [Counter() for _ in range(num_classes)]
            for t, label in zip(texts, labels, strict=True):
                by_class[label].update(set(grams(t[cut], chars)))
            df = sum(by_class, Counter())
            kept = sorted((g for g, n in df.items() if n >= 2), key=lambda g: (-df[g], g))
            kept = kept[: settings["vocab_size"] or MOST_GRAMS]
            vocabulary = {
                "words": GRAMS[kind],  # what grams() makes: a vocabulary of other words stops
                "documents": len(texts),
                "grams": [g.decode("latin-1") for g in kept],  # JSON holds text: a char a byte
                "class_df": [[c[g] for g in kept] for c in by_class],  # [classes][n-grams]
            }
            return cls(kind, max_length, vocabulary=vocabulary)
        tokenizers = _package("tokenizers", "tokenizer bpe")
        bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
        bpe.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()  # words, then merges
        trainer = tokenizers.trainers.BpeTrainer(
            vocab_size=Tokenizer.vocab_of(settings),
            special_tokens=["<pad>"],  # id 0: PAD
            initial_alphabet=[chr(b) for b in range(256)],  # every byte: nothing unknown
            show_progress=False,
        )
        bpe.train_from_iterator((t.decode("latin-1") for t in texts), trainer=trainer)
        return cls("bpe", max_length, bpe)

    def record(self):
        """What a weights file keeps to rebuild this tokenizer (from_record)."""
        return {"kind": self.kind, "json": self.json}

    @classmethod
    def from_record(cls, record, max_length):
        if record["kind"] == "bytes":
            return cls("bytes", max_length)
        if record["kind"] in GRAMS:
            tokenizer = cls(record["kind"], max_length, vocabulary=json.loads(record["json"]))
            tokenizer.json = record["json"]
            return tokenizer
        tokenizers = _package("tokenizers", f"tokenizer {record['kind']}")
        tokenizer = cls(record["kind"], max_length, tokenizers.Tokenizer.from_str(record["json"]))
        tokenizer.json = record["json"]
        return tokenizer

    def encode(self, texts, whole=False):
        """Token ids of each document (bytes), cut at max_length unless `whole`: a list of int
        arrays."""
        limit = None if whole or not self.max_length else self.max_length
        if self.kind in GRAMS:
            ids, chars = [], self.kind == "chars"
            for text in texts:
                found = grams(text[:limit], chars)
                counts = Counter(self.index[g] for g in found if g in self.index)
                ids.append([i * COUNTS + min(n, COUNTS - 1) for i, n in counts.items()])
            return [np.asarray(i, np.int32) for i in ids]
        if self.kind == "bytes":
            return [np.frombuffer(t[:limit], np.uint8).astype(np.int16) + 1 for t in texts]
        if self.kind == "bpe":
            encoded = self.subwords.encode_batch([t.decode("latin-1") for t in texts])
            return [np.asarray(e.ids[:limit], np.int32) for e in encoded]
        if limit:  # the encoder's special tokens ([CLS] ... [SEP]) kept around what is cut
            self.subwords.enable_truncation(limit)
        else:
            self.subwords.no_truncation()
        self.subwords.no_padding()
        encoded = self.subwords.encode_batch([t.decode("utf-8", "replace") for t in texts])
        return [np.asarray(e.ids, np.int32) + 1 for e in encoded]

    def encode_training(self, texts):
        """(token ids cut at max_length, each whole document's length in cut_unit()), in one
        pass: the training split, and what the start-up line says of max_length's cut."""
        if self.kind in GRAMS:  # max_length cuts the bytes, before the n-grams
            return self.encode(texts), [len(t) for t in texts]
        whole = self.encode(texts, whole=True)
        return [t[: self.max_length or None] for t in whole], [len(t) for t in whole]

    def unit(self):
        """What a token id is, for lines that count them."""
        return "bytes" if self.kind == "bytes" else "n-grams" if self.kind in GRAMS else "tokens"

    def cut_unit(self):
        """What max_length counts."""
        return "bytes" if self.kind == "bytes" or self.kind in GRAMS else "tokens"

    def describe(self):
        """A few words on the input, for the start-up line."""
        if self.kind in GRAMS:
            chars = " and their byte 2-4 grams" if self.kind == "chars" else ""
            return f"word 1-2 grams{chars} ({len(self.index):,} of 2 training documents or more)"
        return self.kind


# Words: runs of letters and digits (with ' _ . - inside), and each other byte but white space.
# A word with ' _ . - inside is also its parts: np.linalg.norm is np, linalg and norm too.
WORD = re.compile(rb"[a-z0-9]+(?:['_.-][a-z0-9]+)*|[^\sa-z0-9]")
PART = re.compile(rb"[a-z0-9]+")
# What grams() makes, by tokenizer: the vocabulary's record (a vocabulary of other grams stops).
GRAMS = {"words": "words, their parts, 2-grams of words"}
GRAMS["chars"] = GRAMS["words"] + ", byte 2-4 grams of words"
CHARS = range(2, 5)  # chars: the lengths of a word's byte grams


def grams(text, chars=False):
    """The word 1-grams and 2-grams of a document (bytes), lower-cased (ASCII), in order, then
    the parts of the words that have parts, as 1-grams: a rare name in code still shares its
    parts with the names of the training split. chars: then the byte 2-4 grams of each distinct
    word of 2 bytes or more, within < and > (fastText's subwords), each marked by a # before it:
    an unseen word, or one of another form (Katze, Katzen), shares them with the words of
    training. Measured on short texts in nine languages, 2 points better (docs/text.md)."""
    words = WORD.findall(text.lower())
    parts = [p for w in words if len(w) > 1 and not w.isalnum() for p in PART.findall(w)]
    found = words + [a + b" " + b for a, b in zip(words, words[1:])] + parts
    if chars:
        for w in dict.fromkeys(w for w in words if len(w) > 1):  # each once, in order
            w = b"<" + w + b">"
            found += [b"#" + w[i : i + n] for n in CHARS for i in range(len(w) - n + 1)]
    return found


def _package(name, purpose):
    """An optional package, imported when used, or one line naming the install."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:
            raise
        raise UserError(
            f"{purpose} needs the {name} package: pip install -r requirements-extras.txt"
        ) from None


def describe_model(model, settings, tokenizer):
    """A few words for the start-up line: the model, its size and its input."""
    params = sum(p.numel() for p in model.parameters())
    what = settings["pretrained"] if settings["model"] == "pretrained" else settings["model"]
    words = "its own tokenizer" if settings["model"] == "pretrained" else tokenizer.describe()
    return f"{what} ({params / 1e3:,.0f}k weights) on {words}"
