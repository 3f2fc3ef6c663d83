"""The model zoo: tiny versions of the models people train, and batches for them (tests/test_zoo.py).

Convolutional and recurrent models are written here (torchvision's wheel in this
environment is a CUDA build that does not load); the Hugging Face models are built from
tiny configs with random weights and every dropout probability 0, so that no download is
needed and orttrainer and torch draw no random numbers.
"""

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 99
CLASSES = 5


# ------------------------------------------------------------------ convolutional
def _conv_bn(inputs, outputs, kernel=3, stride=1, groups=1):
    return nn.Sequential(
        nn.Conv2d(inputs, outputs, kernel, stride, padding=kernel // 2, groups=groups, bias=False),
        nn.BatchNorm2d(outputs),
    )


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 conv + BatchNorm, the shortcut projected when the shape changes."""

    def __init__(self, inputs, outputs, stride=1):
        super().__init__()
        self.conv1 = _conv_bn(inputs, outputs, stride=stride)
        self.conv2 = _conv_bn(outputs, outputs)
        reshapes = stride != 1 or inputs != outputs
        self.shortcut = _conv_bn(inputs, outputs, kernel=1, stride=stride) if reshapes else nn.Identity()

    def forward(self, x):
        return F.relu(self.conv2(F.relu(self.conv1(x))) + self.shortcut(x))


class ResNet(nn.Module):
    """A ResNet of basic blocks: a 3x3 stem, two blocks per stage of ``widths`` (each stage after the
    first halves the resolution), pooled classifier. By default 2 stages (widths 8 and 16) for 3x16x16 images."""

    def __init__(self, classes=CLASSES, widths=(8, 16)):
        super().__init__()
        self.stem = nn.Sequential(_conv_bn(3, widths[0]), nn.ReLU())
        stages, inputs = [], widths[0]
        for index, width in enumerate(widths):
            stages.append(nn.Sequential(BasicBlock(inputs, width, stride=1 if index == 0 else 2), BasicBlock(width, width)))
            inputs = width
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(inputs, classes)

    def forward(self, images):
        return self.fc(self.pool(self.stages(self.stem(images))).flatten(1))


class SqueezeExcite(nn.Module):
    """Channel attention as in MobileNetV3: global average, 1x1 conv down and up, hard sigmoid."""

    def __init__(self, channels, squeezed):
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.down = nn.Conv2d(channels, squeezed, 1)
        self.up = nn.Conv2d(squeezed, channels, 1)

    def forward(self, x):
        return x * F.hardsigmoid(self.up(F.relu(self.down(self.pool(x)))))


class InvertedResidual(nn.Module):
    """MobileNetV3's block: 1x1 expansion, depthwise 3x3, squeeze-excitation, 1x1 projection."""

    def __init__(self, inputs, expanded, outputs, stride):
        super().__init__()
        self.expand = nn.Sequential(_conv_bn(inputs, expanded, kernel=1), nn.Hardswish())
        self.depthwise = nn.Sequential(_conv_bn(expanded, expanded, stride=stride, groups=expanded), nn.Hardswish())
        self.excite = SqueezeExcite(expanded, expanded // 4)
        self.project = _conv_bn(expanded, outputs, kernel=1)
        self.residual = stride == 1 and inputs == outputs

    def forward(self, x):
        y = self.project(self.excite(self.depthwise(self.expand(x))))
        return x + y if self.residual else y


class MobileNetV3(nn.Module):
    """A MobileNetV3-style net: hardswish stem, inverted residuals with squeeze-excitation
    (``blocks``: (inputs, expanded, outputs, stride) each), 1x1 head conv to ``head`` channels,
    pooled classifier with hardswish. By default sized for 3x16x16 images."""

    def __init__(self, classes=CLASSES, blocks=((8, 16, 8, 1), (8, 24, 12, 2)), stem_stride=2, head=32, hidden=24):
        super().__init__()
        self.stem = nn.Sequential(_conv_bn(3, blocks[0][0], stride=stem_stride), nn.Hardswish())
        self.blocks = nn.Sequential(*(InvertedResidual(*block) for block in blocks))
        self.head = nn.Sequential(_conv_bn(blocks[-1][2], head, kernel=1), nn.Hardswish(), nn.AdaptiveAvgPool2d(1),
                                  nn.Flatten())  # fmt: skip
        self.classifier = nn.Sequential(nn.Linear(head, hidden), nn.Hardswish(), nn.Linear(hidden, classes))

    def forward(self, images):
        return self.classifier(self.head(self.blocks(self.stem(images))))


class UNet(nn.Module):
    """A two-level U-Net for per-pixel classes: strided-conv down, up by ConvTranspose2d (stride 2) or, with
    ``bilinear``, by bilinear upsampling and a reflection-padded 3x3 conv; skip connection by
    concatenation, BatchNorm throughout."""

    def __init__(self, classes=CLASSES, bilinear=False):
        super().__init__()
        self.encode = nn.Sequential(_conv_bn(3, 8), nn.ReLU())
        self.down = nn.Sequential(_conv_bn(8, 16, stride=2), nn.ReLU(), _conv_bn(16, 16), nn.ReLU())
        self.up = (nn.Sequential(nn.Upsample(scale_factor=2, mode="bilinear"), nn.Conv2d(16, 8, 3, padding=1, padding_mode="reflect"))
                   if bilinear else nn.ConvTranspose2d(16, 8, kernel_size=2, stride=2))  # fmt: skip
        self.decode = nn.Sequential(_conv_bn(16, 8), nn.ReLU())
        self.head = nn.Conv2d(8, classes, 1)

    def forward(self, images):
        skip = self.encode(images)
        return self.head(self.decode(torch.cat([self.up(self.down(skip)), skip], dim=1)))


# ------------------------------------------------------------------ recurrent
class RecurrentClassifier(nn.Module):
    """Embedding (padding_idx 0) + LSTM over right-padded token sequences; the class scores come
    from the LSTM output at each sequence's last real token (``lengths - 1``)."""

    def __init__(self, classes=CLASSES, width=16, hidden=24):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, width, padding_idx=0)
        self.lstm = nn.LSTM(width, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, tokens, lengths):
        states, _ = self.lstm(self.tokens(tokens))
        return self.head(states[torch.arange(tokens.shape[0]), lengths - 1])


class BagOfWordsClassifier(nn.Module):
    """The PyTorch text-classification tutorial's model: nn.EmbeddingBag (the mean of each text's
    token embeddings; the texts concatenated, ``offsets`` marking where each starts) + a linear head."""

    def __init__(self, classes=CLASSES, width=16):
        super().__init__()
        self.bag = nn.EmbeddingBag(VOCAB, width, mode="mean")
        self.head = nn.Linear(width, classes)

    def forward(self, text, offsets):
        return self.head(self.bag(text, offsets))


# ------------------------------------------------------------------ spectral norm, vector quantization
def _spectral_norm(layer):
    return nn.utils.parametrizations.spectral_norm(layer)


class SpectralNormDiscriminator(nn.Module):
    """An SNGAN-style discriminator: two strided convolutions with leaky ReLUs and a linear head, each weight
    spectral-normalized (its power iteration writes the buffers u and v in every training forward)."""

    def __init__(self, classes=CLASSES, size=16):
        super().__init__()
        self.features = nn.Sequential(_spectral_norm(nn.Conv2d(3, 8, 3, stride=2, padding=1)), nn.LeakyReLU(0.1),
                                      _spectral_norm(nn.Conv2d(8, 16, 3, stride=2, padding=1)), nn.LeakyReLU(0.1),
                                      nn.Flatten())  # fmt: skip
        self.head = _spectral_norm(nn.Linear(16 * (size // 4) ** 2, classes))

    def forward(self, images):
        return self.head(self.features(images))


class _Autoencoder(nn.Module):
    """A convolutional encoder of 3xHxW images to an (H/2)x(W/2) grid of ``width``-vectors and its transposed
    decoder; ``quantize(z)`` (rows of z) gives (the vectors the decoder reads, the loss the model adds)."""

    def __init__(self, width):
        super().__init__()
        self.width = width
        self.encoder = nn.Sequential(nn.Conv2d(3, 16, 4, stride=2, padding=1), nn.ReLU(), nn.Conv2d(16, width, 1))
        self.decoder = nn.Sequential(nn.ConvTranspose2d(width, 16, 4, stride=2, padding=1), nn.ReLU(), nn.Conv2d(16, 3, 1))

    def forward(self, images):
        encoded = self.encoder(images)
        batch, _, height, width = encoded.shape
        quantized, own_loss = self.quantize(encoded.permute(0, 2, 3, 1).reshape(-1, self.width))
        return self.decoder(quantized.reshape(batch, height, width, self.width).permute(0, 3, 1, 2)), own_loss


def _squared_distances(z, codebook):
    """|z|^2 - 2 z.w + |w|^2 between each row of z and each codebook row."""
    return (z**2).sum(1, keepdim=True) - 2 * z @ codebook.t() + (codebook**2).sum(1)


class VQVAE(_Autoencoder):
    """A VQ-VAE: each encoded vector z replaced by its nearest codebook row q (argmin of the distances: ``cdist`` or
    the expanded |z|^2 - 2 z.w + |w|^2), passed straight through (``z + (q - z).detach()``); the model adds the
    codebook loss plus ``beta`` times the commitment loss. ``lookup``: how q reads the codebook (the nn.Embedding
    called, ``F.embedding`` of its weight, or the weight indexed)."""

    def __init__(self, lookup="module", distance="expanded", beta=0.25, codes=16, width=8):
        super().__init__(width)
        self.codebook = nn.Embedding(codes, width)
        self.lookup, self.distance, self.beta = lookup, distance, beta

    def _distances(self, z):
        if self.distance == "cdist":  # a fixed compute mode: torch's default changes its formula with the row count
            return torch.cdist(z, self.codebook.weight, compute_mode="donot_use_mm_for_euclid_dist")
        return _squared_distances(z, self.codebook.weight)

    def _quantized(self, indices):
        if self.lookup == "module":
            return self.codebook(indices)
        if self.lookup == "functional":
            return F.embedding(indices, self.codebook.weight)
        return self.codebook.weight[indices]

    def quantize(self, z):
        q = self._quantized(self._distances(z).argmin(1))
        vq_loss = F.mse_loss(q, z.detach()) + self.beta * F.mse_loss(z, q.detach())
        return z + (q - z).detach(), vq_loss


class EMAVQVAE(_Autoencoder):
    """VQ-VAE-2's quantizer: the codebook is no parameter but a buffer that training forward moves by exponential
    moving averages (``decay``, under no_grad) of each code's count of the vectors nearest to it and of their sum,
    the counts Laplace-smoothed (``eps``); the model adds the commitment loss only (``beta``)."""

    def __init__(self, codes=16, width=8, decay=0.9, beta=0.25, eps=1e-5):
        super().__init__(width)
        self.decay, self.beta, self.eps = decay, beta, eps
        self.register_buffer("codebook", torch.randn(codes, width))
        self.register_buffer("counts", torch.ones(codes))
        self.register_buffer("sums", self.codebook.clone())

    def quantize(self, z):
        indices = _squared_distances(z, self.codebook).argmin(1)
        if self.training:
            with torch.no_grad():
                nearest = F.one_hot(indices, len(self.codebook)).type_as(z)
                self.counts.mul_(self.decay).add_(nearest.sum(0), alpha=1 - self.decay)
                self.sums.mul_(self.decay).add_(nearest.t() @ z, alpha=1 - self.decay)
                total = self.counts.sum()
                smoothed = (self.counts + self.eps) / (total + len(self.codebook) * self.eps) * total
                self.codebook.copy_(self.sums / smoothed.unsqueeze(1))
        q = F.embedding(indices, self.codebook)
        return z + (q - z).detach(), self.beta * F.mse_loss(z, q.detach())


def reconstruction_plus_own_loss(outputs, target):
    """The mean squared error of an autoencoder's reconstruction plus the loss the model adds (a VQ-VAE's codebook
    and commitment losses). Written out, not F.mse_loss: the trace of its broadcast makes the saved ONNX model
    without the loss read the label's shape (open, reported with issue 46)."""
    reconstruction, own_loss = outputs
    return ((reconstruction - target) ** 2).mean() + own_loss


# ------------------------------------------------------------------ batches
def image_batch(batch, size=16, generator=None):
    """(images [batch, 3, size, size], class per image)."""
    images = torch.randn(batch, 3, size, size, generator=generator)
    return images, torch.randint(0, CLASSES, (batch,), generator=generator)


def autoencoder_batch(batch, size=8, generator=None):
    """(images [batch, 3, size, size], the same images as the target)."""
    images = torch.randn(batch, 3, size, size, generator=generator)
    return images, images


def segmentation_batch(batch, size=16, generator=None):
    """(images [batch, 3, size, size], class per pixel [batch, size, size])."""
    images = torch.randn(batch, 3, size, size, generator=generator)
    return images, torch.randint(0, CLASSES, (batch, size, size), generator=generator)


def _lengths(batch, longest, generator):
    """Sequence lengths in 2..longest, one of them ``longest`` (the padded width of the batch)."""
    lengths = torch.randint(2, longest + 1, (batch,), generator=generator)
    lengths[torch.randint(0, batch, (1,), generator=generator)] = longest
    return lengths


def _padded_tokens(lengths, pad, generator):
    """Token ids in 3..VOCAB-1 (0-2 are special), ``pad`` after each length; and the attention mask."""
    longest = int(lengths.max())
    mask = (torch.arange(longest) < lengths[:, None]).long()
    tokens = torch.randint(3, VOCAB, (len(lengths), longest), generator=generator)
    return tokens.masked_fill(mask == 0, pad), mask


def padded_token_batch(batch, longest, generator=None):
    """(tokens padded with 0 to ``longest``, lengths, class per sequence) for RecurrentClassifier."""
    lengths = _lengths(batch, longest, generator)
    tokens, _ = _padded_tokens(lengths, 0, generator)
    return tokens, lengths, torch.randint(0, CLASSES, (batch,), generator=generator)


def concatenated_text_batch(batch, longest, generator=None):
    """(the token ids of ``batch`` texts of lengths 2..longest in one row, where each text starts,
    class per text) for BagOfWordsClassifier: a batch's length depends on its values."""
    lengths = _lengths(batch, longest, generator)
    text = torch.randint(3, VOCAB, (int(lengths.sum()),), generator=generator)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    return text, offsets, torch.randint(0, CLASSES, (batch,), generator=generator)


# ------------------------------------------------------------------ Hugging Face
def _text_batch(batch, longest, pad, generator):
    lengths = _lengths(batch, longest, generator)
    input_ids, attention_mask = _padded_tokens(lengths, pad, generator)
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def masked_lm_batch(batch, longest, pad=0, generator=None):
    """Tokens, attention mask, and labels -100 (ignored) except at ~30% of the real tokens."""
    inputs = _text_batch(batch, longest, pad, generator)
    chosen = (torch.rand(inputs["input_ids"].shape, generator=generator) < 0.3) & (inputs["attention_mask"] == 1)
    chosen[:, 0] = True  # at least one label per sequence
    labels = inputs["input_ids"].masked_fill(~chosen, -100)
    return {**inputs, "input_ids": inputs["input_ids"].masked_fill(chosen, 4), "labels": labels}  # 4 stands for [MASK]


def causal_lm_batch(batch, longest, pad=0, generator=None):
    """Tokens, attention mask, and the tokens as labels (-100 on padding; the model shifts them)."""
    inputs = _text_batch(batch, longest, pad, generator)
    return {**inputs, "labels": inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)}


def left_padded_causal_lm_batch(batch, longest, pad=0, generator=None):
    """causal_lm_batch padded on the left, as for generation: under the causal mask the padding's
    queries see no key at all."""
    return {name: tensor.flip(-1) for name, tensor in causal_lm_batch(batch, longest, pad, generator).items()}


def question_answering_batch(batch, longest, pad=0, generator=None):
    """Tokens, attention mask, and answer start/end positions, some past the sequence (the model clamps
    them to its length and ignores them: its loss's ignore_index is that length, a size)."""
    inputs = _text_batch(batch, longest, pad, generator)
    starts = torch.randint(0, longest + 3, (batch,), generator=generator)
    return {**inputs, "start_positions": starts, "end_positions": starts + torch.randint(0, 3, (batch,), generator=generator)}


def classification_batch(batch, longest, pad=0, generator=None, classes=3):
    inputs = _text_batch(batch, longest, pad, generator)
    return {**inputs, "labels": torch.randint(0, classes, (batch,), generator=generator)}


def seq2seq_batch(batch, longest, pad=0, generator=None):
    """Source tokens and mask, target labels (-100 on padding) of a different length; the model
    builds decoder_input_ids by shifting the labels, as when a user passes only labels."""
    inputs = _text_batch(batch, longest, pad, generator)
    target = causal_lm_batch(batch, longest - 2, pad, generator)["labels"]
    return {**inputs, "labels": target}


def vit_batch(batch, size=16, generator=None, classes=3):
    images = torch.randn(batch, 3, size, size, generator=generator)
    return {"pixel_values": images, "labels": torch.randint(0, classes, (batch,), generator=generator)}


def resized_vit_batch(batch, size=16, generator=None, classes=3):
    """A vit_batch asking the model to resize its position embeddings to the image (a Python flag: a step constant)."""
    return {**vit_batch(batch, size, generator, classes), "interpolate_pos_encoding": True}



_ENCODER = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
            "intermediate_size": 37, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}  # fmt: skip


def bert_masked_lm():
    import transformers

    config = transformers.BertConfig(**_ENCODER, max_position_embeddings=64, pad_token_id=0)
    return transformers.BertForMaskedLM(config)


def bert_classifier():
    import transformers

    config = transformers.BertConfig(**_ENCODER, max_position_embeddings=64, pad_token_id=0, num_labels=3)
    return transformers.BertForSequenceClassification(config)


def roberta_masked_lm():
    import transformers

    config = transformers.RobertaConfig(**_ENCODER, max_position_embeddings=66, pad_token_id=1, bos_token_id=0,
                                        eos_token_id=2)  # fmt: skip
    return transformers.RobertaForMaskedLM(config)


def distilbert_classifier():
    import transformers

    config = transformers.DistilBertConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, hidden_dim=37, dropout=0.0,
                                           attention_dropout=0.0, seq_classif_dropout=0.0, max_position_embeddings=64,
                                           pad_token_id=0, num_labels=3)  # fmt: skip
    return transformers.DistilBertForSequenceClassification(config)


def gpt2_lm():
    import transformers

    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=1, eos_token_id=2,
                                     pad_token_id=0)  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def gpt2_classifier():
    """GPT-2 reading each sequence's last token that is not padding (its logits flattened, then gathered)."""
    import transformers

    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0, use_cache=False,
                                     bos_token_id=1, eos_token_id=2, pad_token_id=0, num_labels=3)  # fmt: skip
    return transformers.GPT2ForSequenceClassification(config)


def bloom_lm():
    """BLOOM: ALiBi attention biases, its tanh GELU through a custom autograd Function whose backward is the
    gradient of its forward (refusals.GRADIENT_OF_THEIR_FORWARD)."""
    import transformers

    config = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=2, hidden_dropout=0.0,
                                      attention_dropout=0.0, use_cache=False, pad_token_id=0, bos_token_id=1,
                                      eos_token_id=2)  # fmt: skip
    return transformers.BloomForCausalLM(config)


_LLAMA_LIKE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64, use_cache=False, pad_token_id=0, bos_token_id=1,
                   eos_token_id=2)


def llama_lm():
    """Llama's layout: rotary positions, RMSNorm, SiLU-gated MLP, grouped-query attention (4 heads, 2 key/value)."""
    import transformers

    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**_LLAMA_LIKE))


def llama_classifier():
    """Llama's layout (llama_lm) reading each sequence's last token that is not padding."""
    import transformers

    return transformers.LlamaForSequenceClassification(transformers.LlamaConfig(**_LLAMA_LIKE, num_labels=3))


def mamba_lm():
    """Mamba: gated 1-d convolutions and a selective state-space scan (transformers' torch path, no mamba_ssm). Its
    Tile of repeats computed from the length fails ONNX Runtime's shape inference with the lengths dynamic: the
    trainer builds it with fixed lengths, a graph per length (graph_cache.GraphCache._build)."""
    import transformers

    config = transformers.MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2,
                                      conv_kernel=4, use_cache=False)  # fmt: skip
    return transformers.MambaForCausalLM(config)


def cohere_lm():
    """Cohere (Command-R): Llama's layout with LayerNorm, parallel attention and MLP, and rotary positions interleaved by
    ``repeat_interleave(freqs, 2, dim=-1)``, whose torch symbolic turned the trace's shared -1 into 2 for the ops
    after it (symbolics.indexing.repeat_interleave)."""
    import transformers

    return transformers.CohereForCausalLM(transformers.CohereConfig(**_LLAMA_LIKE, logit_scale=0.5))


def mixtral_lm(**changes):
    """Mixtral: a mixture of 4 SiLU-gated experts, 2 per token, routed by softmax over a gate, in transformers' default
    experts implementation ("grouped_mm": tokens sorted by expert and counted with torch.histc), which the trainer
    traces with every expert computing every token (export/experts.py). ``changes`` go to the config."""
    import transformers

    config = transformers.MixtralConfig(**{**dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40,
                                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                  max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
                                                  attention_dropout=0.0, router_jitter_noise=0.0, use_cache=False,
                                                  pad_token_id=0, bos_token_id=1, eos_token_id=2), **changes})  # fmt: skip
    return transformers.MixtralForCausalLM(config)


def t5_generator():
    import transformers

    config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=37, num_layers=2, num_decoder_layers=2,
                                   num_heads=2, relative_attention_num_buckets=8, relative_attention_max_distance=20,
                                   dropout_rate=0.0, use_cache=False, pad_token_id=0, eos_token_id=1,
                                   decoder_start_token_id=0)  # fmt: skip
    return transformers.T5ForConditionalGeneration(config)


# BART's layout, which NLLB-MoE shares: 2 layers each side, width 32, pad 1
_SEQ2SEQ = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                decoder_attention_heads=2, encoder_ffn_dim=37, decoder_ffn_dim=37, dropout=0.0, attention_dropout=0.0,
                activation_dropout=0.0, max_position_embeddings=64, use_cache=False, pad_token_id=1, bos_token_id=0,
                eos_token_id=2, decoder_start_token_id=2)


def bart_generator():
    import transformers

    return transformers.BartForConditionalGeneration(transformers.BartConfig(**_SEQ2SEQ))


def nllb_moe_generator():
    """NLLB-MoE: every second layer a mixture of 4 experts, 2 per token, whose outputs index_add_ sums back into the
    tokens; a token sent to two experts is a repeated index, of which torch's exporter kept one (symbolics.indexing.index_add).
    The capacities (64 tokens per expert in training, 4x the batch's tokens in eval) drop no token in either mode, so
    eval mode routes as the training graph does (the eval graph is the training trace, as in the legacy ORTTrainer)."""
    import transformers

    config = transformers.NllbMoeConfig(**_SEQ2SEQ, num_experts=4, expert_capacity=64, moe_eval_capacity_token_fraction=4.0,
                                        encoder_sparse_step=2, decoder_sparse_step=2, router_z_loss_coef=0.001,
                                        router_aux_loss_coef=0.001, moe_token_dropout=0.0, router_dtype="float32",
                                        second_expert_policy="all", encoder_layerdrop=0.0,
                                        decoder_layerdrop=0.0)  # fmt: skip
    return transformers.NllbMoeForConditionalGeneration(config)


def squeezebert_classifier():
    """Grouped 1-d convolutions in place of every dense layer (groups 2): ONNX Runtime's CPU gradient of a grouped
    1-d convolution wrote past its end (rewrites.convolutions.grouped_convolution), which gave this model a loss of -0."""
    import transformers

    groups = dict.fromkeys(("q_groups", "k_groups", "v_groups", "post_attention_groups", "intermediate_groups", "output_groups"), 2)
    config = transformers.SqueezeBertConfig(**{**_ENCODER, "intermediate_size": 36}, **groups, embedding_size=32,
                                            max_position_embeddings=64, pad_token_id=0, num_labels=3)  # fmt: skip
    return transformers.SqueezeBertForSequenceClassification(config)


def convbert_classifier():
    """Span-based dynamic convolution beside self-attention, through a depthwise separable 1-d convolution (a grouped
    Conv1d; see squeezebert_classifier)."""
    import transformers

    config = transformers.ConvBertConfig(**{**_ENCODER, "num_attention_heads": 4}, embedding_size=32, head_ratio=2,
                                         conv_kernel_size=3, num_groups=1, max_position_embeddings=64, pad_token_id=0,
                                         num_labels=3)  # fmt: skip
    return transformers.ConvBertForSequenceClassification(config)


def xlnet_classifier():
    """Relative attention written as einsums of several free indices ('ibnd,jbnd->bnij', 'ibh,hnd->ibnd'), rewritten
    into batched MatMuls (rewrites.einsum). ``use_mems_eval=False``: by default XLNet returns its memories in eval
    mode only, and a trainer's outputs are the same in both modes (refused by name otherwise)."""
    import transformers

    config = transformers.XLNetConfig(vocab_size=VOCAB, d_model=32, n_layer=2, n_head=2, d_inner=37, dropout=0.0,
                                      summary_last_dropout=0.0, use_mems_train=False, use_mems_eval=False, mem_len=None,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2, num_labels=3)  # fmt: skip
    return transformers.XLNetForSequenceClassification(config)


def bert_question_answering():
    """Start and end scores from one Linear, split(1, dim=-1) and squeeze(-1): the exporter writes an If for
    the squeeze of a dimension it cannot size (rewrites.fold_static_sizes)."""
    import transformers

    return transformers.BertForQuestionAnswering(transformers.BertConfig(**_ENCODER, max_position_embeddings=64, pad_token_id=0))


def efficientnet_classifier():
    """EfficientNet: a ZeroPad2d before its strided stem, depthwise convolutions, squeeze-excite, SiLU, and an
    AvgPool2d(1280, ceil_mode=True) over the last small map as its pooler."""
    import transformers

    config = transformers.EfficientNetConfig(
        image_size=32, width_coefficient=1.0, depth_coefficient=1.0, kernel_sizes=[3, 3, 5], in_channels=[32, 8, 16],
        out_channels=[8, 16, 24], strides=[1, 2, 2], num_block_repeats=[1, 1, 1], expand_ratios=[1, 2, 2], hidden_dim=1280,
        dropout_rate=0.0, drop_connect_rate=0.0, num_labels=3,
    )  # fmt: skip
    return transformers.EfficientNetForImageClassification(config)


def mobilevit_classifier():
    """MobileViT: convolutions with BatchNorm (SiLU), inverted residuals, and transformer blocks over the unfolded
    patches of a feature map, folded back and fused with it by convolutions. Some gradients nearly cancel (attention
    and BatchNorm biases): the first-step check finds them rounded otherwise and takes torch's step again for its
    rounding excuse, which started from the statistics the checked run had moved, and refused the step (issue 47)."""
    import transformers

    config = transformers.MobileViTConfig(image_size=32, patch_size=2, hidden_sizes=[16, 24, 32],
                                          neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 32], num_attention_heads=2,
                                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                          classifier_dropout_prob=0.0, num_labels=3)  # fmt: skip
    return transformers.MobileViTForImageClassification(config)


def vit_classifier():
    import transformers

    config = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=2, intermediate_size=37, hidden_dropout_prob=0.0,
                                    attention_probs_dropout_prob=0.0, num_labels=3)  # fmt: skip
    return transformers.ViTForImageClassification(config)


def dinov2_classifier():
    """DINOv2: its position embeddings, reshaped to the square root of their count, are resized (bicubic) to the
    image's patch grid at every call under tracing; those sizes come from Pow, Div and Cast of sizes
    (rewrites.fold_static_sizes makes them constants of each image size's graph)."""
    import transformers

    config = transformers.Dinov2Config(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2,
                                       num_attention_heads=2, mlp_ratio=2, hidden_dropout_prob=0.0,
                                       attention_probs_dropout_prob=0.0, drop_path_rate=0.0, num_labels=3)  # fmt: skip
    return transformers.Dinov2ForImageClassification(config)


def beit_classifier():
    """BEiT with a relative position bias per layer: a table resized (bilinear) to the patch grid at sizes computed
    from the window's (rewrites.fold_static_sizes). With interpolate_pos_encoding=True it resizes the bias again to
    the sequence's length, which ONNX's inference cannot follow through a Reshape to -1 of a dynamic batch: refused,
    naming the Resize (ViT's, which resizes only its position embeddings, trains: vit-resized-positions)."""
    import transformers

    config = transformers.BeitConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=37, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, drop_path_rate=0.0,
                                     use_relative_position_bias=True, use_mean_pooling=True, num_labels=3)  # fmt: skip
    return transformers.BeitForImageClassification(config)


def clip_model():
    """CLIP: a text and a vision transformer, their pooled outputs projected and compared; CLIPOutput holds each
    tower's BaseModelOutputWithPooling (nested ModelOutputs), and its loss pairs the batch's i-th caption and image."""
    import transformers

    tower = {"hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2, "num_attention_heads": 2,
             "attention_dropout": 0.0}  # fmt: skip
    config = transformers.CLIPConfig(
        text_config={**tower, "vocab_size": VOCAB, "max_position_embeddings": 16, "pad_token_id": 0, "bos_token_id": 1,
                     "eos_token_id": 2},
        vision_config={**tower, "image_size": 16, "patch_size": 8}, projection_dim=16,
    )  # fmt: skip
    return transformers.CLIPModel(config)


def wav2vec2_audio_classifier(**config_changes):
    """Wav2Vec2 on raw audio: a strided Conv1d feature extractor with GroupNorm, a grouped positional
    convolution under weight norm, an attention encoder, mean pooling into a classifier. Its attention's
    gradient came out wrong under ONNX Runtime's MatMulScaleFusion (session._DISABLED_OPTIMIZERS), most likely
    from the grouped convolution's gradient writing past its end (rewrites.convolutions.grouped_convolution)."""
    import transformers

    config = transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37, conv_dim=(16, 16),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
        feat_extract_norm="group", hidden_dropout=0.0, activation_dropout=0.0, attention_dropout=0.0, feat_proj_dropout=0.0,
        final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, apply_spec_augment=False, classifier_proj_size=16, num_labels=3,
    )  # fmt: skip
    for key, value in config_changes.items():
        setattr(config, key, value)
    return transformers.Wav2Vec2ForSequenceClassification(config)


def whisper_speech_to_text():
    """Whisper: Conv1d over log-mel features, an encoder-decoder transformer; given labels only, it shifts them
    into decoder inputs, and transformers' packed-sequence check runs torch.diff and a cumsum of bools."""
    import transformers

    config = transformers.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=8, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, d_model=32, encoder_ffn_dim=37, decoder_ffn_dim=37, max_source_positions=16,
        max_target_positions=32, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, use_cache=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, begin_suppress_tokens=None,
        suppress_tokens=None,
    )  # fmt: skip
    return transformers.WhisperForConditionalGeneration(config)


def speech_batch(batch, generator=None):
    """Log-mel features (8 bins, 32 frames) and transcripts of 3 + batch tokens, the last of one ignored."""
    labels = torch.randint(3, VOCAB, (batch, 3 + batch), generator=generator)
    labels[0, -1] = -100
    return {"input_features": torch.randn(batch, 8, 32, generator=generator), "labels": labels}


def image_text_batch(batch, longest, pad=0, generator=None, size=16):
    """Captions (tokens and attention mask) with one image each, and return_loss=True: CLIP's contrastive loss, which
    it computes only when asked (a constant of the step, not a tensor)."""
    inputs = _text_batch(batch, longest, pad, generator)
    return {**inputs, "pixel_values": torch.randn(batch, 3, size, size, generator=generator), "return_loss": True}


def audio_batch(batch, samples=400, generator=None, classes=3):
    return {"input_values": torch.randn(batch, samples, generator=generator),
            "labels": torch.randint(0, classes, (batch,), generator=generator)}  # fmt: skip


# ------------------------------------------------------------------ the zoo, listed
# name: (model factory, batch factory, what the batch factory's shape is). A batch factory takes
# (batch,) for "images" and "audio", (batch, image size) for "image sizes", and (batch, padded length) for
# "tokens" and "short tokens" (at most 16: CLIP's positions), then generator=. The torch
# models return class scores for F.cross_entropy; the Hugging Face ones take the batch as
# keywords, labels (or CLIP's return_loss=True) included, and return a ModelOutput with their own loss.
TORCH_MODELS = {
    "resnet-basic-blocks-batchnorm": (ResNet, image_batch, "images"),
    "mobilenet-v3-depthwise-hardswish-squeeze-excite": (MobileNetV3, image_batch, "images"),
    "unet-conv-transpose-batchnorm": (UNet, segmentation_batch, "images"),
    "unet-bilinear-reflect-pad-batchnorm": (functools.partial(UNet, bilinear=True), segmentation_batch, "images"),
    "lstm-over-padded-batches-of-changing-length": (RecurrentClassifier, padded_token_batch, "tokens"),
    "embedding-bag-over-texts-of-changing-length": (BagOfWordsClassifier, concatenated_text_batch, "tokens"),
    "sngan-discriminator-spectral-norm": (SpectralNormDiscriminator, image_batch, "images"),
}
# The autoencoders: the same, but the batch is (images, images) and the model returns (reconstruction, the loss it
# adds), trained with reconstruction_plus_own_loss.
AUTOENCODERS = {
    "vq-vae-straight-through-codebook": (VQVAE, autoencoder_batch, "images"),
    "vq-vae-2-ema-codebook-buffers": (EMAVQVAE, autoencoder_batch, "images"),
}
HUGGING_FACE_MODELS = {
    "bert-masked-lm": (bert_masked_lm, masked_lm_batch, "tokens"),
    "bert-classifier": (bert_classifier, classification_batch, "tokens"),
    "distilbert-classifier": (distilbert_classifier, classification_batch, "tokens"),
    "roberta-masked-lm": (roberta_masked_lm, functools.partial(masked_lm_batch, pad=1), "tokens"),
    "gpt2-lm": (gpt2_lm, causal_lm_batch, "tokens"),
    "llama-lm": (llama_lm, causal_lm_batch, "tokens"),
    "cohere-interleaved-rotary-lm": (cohere_lm, causal_lm_batch, "tokens"),
    "mamba-selective-scan-lm": (mamba_lm, causal_lm_batch, "tokens"),
    "mixtral-mixture-of-experts-lm": (mixtral_lm, causal_lm_batch, "tokens"),
    "t5": (t5_generator, seq2seq_batch, "tokens"),
    "bart": (bart_generator, functools.partial(seq2seq_batch, pad=1), "tokens"),
    "nllb-moe-index-add-experts-generator": (nllb_moe_generator, functools.partial(seq2seq_batch, pad=1), "tokens"),
    "vit-image-classifier": (vit_classifier, vit_batch, "images"),
    "wav2vec2-audio-classifier": (wav2vec2_audio_classifier, audio_batch, "audio"),
    "bert-question-answering": (bert_question_answering, question_answering_batch, "tokens"),
    "squeezebert-grouped-conv1d-classifier": (squeezebert_classifier, classification_batch, "tokens"),
    "convbert-depthwise-conv1d-classifier": (convbert_classifier, classification_batch, "tokens"),
    "xlnet-einsum-attention-classifier": (xlnet_classifier, classification_batch, "tokens"),
    "whisper-speech-to-text": (whisper_speech_to_text, speech_batch, "audio"),
    "bloom-lm": (bloom_lm, causal_lm_batch, "tokens"),
    "efficientnet-image-classifier": (efficientnet_classifier, functools.partial(vit_batch, size=32), "images"),
    "mobilevit-batchnorm-and-attention-classifier": (mobilevit_classifier, functools.partial(vit_batch, size=32),
                                                     "images"),
    "clip-contrastive-return-loss": (clip_model, image_text_batch, "short tokens"),
    "vit-resized-positions": (vit_classifier, resized_vit_batch, "image sizes"),
    "dinov2-image-classifier": (dinov2_classifier, vit_batch, "image sizes"),
    "beit-image-classifier": (beit_classifier, vit_batch, "images"),
}
