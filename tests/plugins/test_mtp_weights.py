"""Loading MTP head weights: specdec's own layout and Xiaomi MiMo's (a tiny random checkpoint
written the way MiMo's safetensors name and shape them), shape checks."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from specdec.errors import SpecdecError
from specdec.plugins.mtp.weights import (DECODER_NAMES, MtpLayerWeights, load_mtp_layers,
                                         save_mtp_layers)

H, I, NH, NKV, D, V = 64, 128, 4, 2, 16, 256


def random_layer(rng, final_norm: bool) -> MtpLayerWeights:
    def m(rows, cols):
        return rng.standard_normal((rows, cols)).astype(np.float32)

    decoder = {"input_layernorm.weight": rng.random(H, np.float32) + 0.5,
               "post_attention_layernorm.weight": rng.random(H, np.float32) + 0.5,
               "self_attn.q_proj.weight": m(NH * D, H), "self_attn.k_proj.weight": m(NKV * D, H),
               "self_attn.v_proj.weight": m(NKV * D, H), "self_attn.o_proj.weight": m(H, NH * D),
               "mlp.gate_proj.weight": m(I, H), "mlp.up_proj.weight": m(I, H), "mlp.down_proj.weight": m(H, I),
               "self_attn.q_proj.bias": m(1, NH * D)[0], "self_attn.k_proj.bias": m(1, NKV * D)[0],
               "self_attn.v_proj.bias": m(1, NKV * D)[0]}
    return MtpLayerWeights(enorm=rng.random(H, np.float32) + 0.5, hnorm=rng.random(H, np.float32) + 0.5,
                           embed_proj=m(H, H), hidden_proj=m(H, H), decoder=decoder,
                           final_norm=rng.random(H, np.float32) + 0.5 if final_norm else None)


def assert_same(got: MtpLayerWeights, want: MtpLayerWeights, dtype=np.float32):
    for name in ("enorm", "hnorm", "embed_proj", "hidden_proj", "final_norm"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is not None:
            np.testing.assert_array_equal(a, b.astype(dtype).astype(np.float32), err_msg=name)
    assert sorted(got.decoder) == sorted(want.decoder)
    for name, value in want.decoder.items():
        np.testing.assert_array_equal(got.decoder[name], value.astype(dtype).astype(np.float32), err_msg=name)


@pytest.mark.parametrize("final_norm", [False, True])
def test_specdec_layout_round_trip(tmp_path, final_norm):
    rng = np.random.default_rng(0)
    layers = [random_layer(rng, final_norm), random_layer(rng, final_norm)]
    path = tmp_path / "head.safetensors"
    save_mtp_layers(layers, path, dtype="float32")
    loaded = load_mtp_layers(path, H)
    assert len(loaded) == 2
    for got, want in zip(loaded, layers):
        assert_same(got, want)
    save_mtp_layers(layers, tmp_path / "half.safetensors")  # float16 by default: half the size
    assert_same(load_mtp_layers(tmp_path / "half.safetensors", H)[1], layers[1], dtype=np.float16)


def write_mimo_checkpoint(directory, layers: list[MtpLayerWeights], rng) -> None:
    """A MiMo-7B-shaped checkpoint in miniature: config.json, the target's own tensors, and
    ``model.mtp_layers.{i}.*`` with ``input_proj`` on concat(hidden, embedding), torch [out, in]."""
    directory.mkdir()
    config = {"architectures": ["MiMoForCausalLM"], "model_type": "mimo", "hidden_size": H,
              "intermediate_size": I, "num_attention_heads": NH, "num_key_value_heads": NKV, "head_dim": D,
              "num_hidden_layers": 1, "vocab_size": V, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "attention_bias": True, "num_nextn_predict_layers": len(layers)}
    (directory / "config.json").write_text(json.dumps(config))
    target = {"model.embed_tokens.weight": rng.standard_normal((V, H)).astype(np.float32),
              "lm_head.weight": rng.standard_normal((V, H)).astype(np.float32),
              "model.norm.weight": np.ones(H, np.float32),
              "model.layers.0.input_layernorm.weight": np.ones(H, np.float32)}
    mtp = {}
    for i, layer in enumerate(layers):
        prefix = f"model.mtp_layers.{i}."
        mtp[prefix + "token_layernorm.weight"] = layer.enorm
        mtp[prefix + "hidden_layernorm.weight"] = layer.hnorm
        mtp[prefix + "input_proj.weight"] = np.concatenate([layer.hidden_proj, layer.embed_proj], axis=1)
        mtp[prefix + "final_layernorm.weight"] = layer.final_norm
        mtp.update({prefix + name: value for name, value in layer.decoder.items()})
    # Sharded as the real checkpoints are: the MTP layers in a file of their own.
    save_file(target, str(directory / "model-00001-of-00002.safetensors"))
    save_file(mtp, str(directory / "model-00002-of-00002.safetensors"))


def test_mimo_layout_loads_with_the_projection_halves_swapped(tmp_path):
    rng = np.random.default_rng(1)
    layers = [random_layer(rng, final_norm=True)]
    write_mimo_checkpoint(tmp_path / "mimo", layers, rng)
    [loaded] = load_mtp_layers(tmp_path / "mimo", H)
    assert_same(loaded, layers[0])  # embedding half and hidden half where they belong
    assert set(loaded.decoder) == set(DECODER_NAMES) | {"self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                                        "self_attn.v_proj.bias"}


def test_bad_files_are_one_line_errors(tmp_path):
    rng = np.random.default_rng(2)
    with pytest.raises(SpecdecError, match=r"^speculative_config.model: .*nowhere does not exist$"):
        load_mtp_layers(tmp_path / "nowhere", H)
    save_file({"x": np.zeros(3, np.float32)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(SpecdecError, match="holds no MTP layer"):
        load_mtp_layers(tmp_path / "other.safetensors", H)
    save_mtp_layers([random_layer(rng, False)], tmp_path / "head.safetensors")
    with pytest.raises(SpecdecError, match=r"enorm has shape \[64\], the target's hidden size 576 needs \[576\]"):
        load_mtp_layers(tmp_path / "head.safetensors", 576)
    (tmp_path / "broken.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(SpecdecError, match="cannot read"):
        load_mtp_layers(tmp_path / "broken.safetensors", H)


