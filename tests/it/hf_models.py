"""The transformers side of tests/it/hf.rs.

make OUT: writes random-init checkpoints with save_pretrained (no download) and the logits of
fixed tokens in fp32: OUT/gpt2 (GPT2LMHeadModel, gelu_new), OUT/llama (LlamaForCausalLM with
grouped-query attention and an untied head) and OUT/llama-tied (tied head, Llama 3.1's rope
scaling, saved in shards with an index). Each folder gets expected.json: the tokens and logits.

logits DIR TOKENS_JSON: loads DIR with from_pretrained and prints the logits of the tokens as JSON.

peft BASE ADAPTER TOKENS_JSON: the same for the base model with peft's adapter loaded over it.
"""

import json
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

torch.set_num_threads(1)
VOCAB = 256
TOKENS = [[1, 5, 9, 94, 3, 3, 60, 12, 7, 0, 33, 81], [95, 2, 4, 8, 16, 32, 64, 1, 11, 22, 44, 88]]


def perturb(model):
    # A fresh init has unit norms and zero biases, which would hide a mix-up of those tensors.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)


def logits(model, tokens):
    model.eval()
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float()


def save(model, out, **kwargs):
    model.save_pretrained(out, **kwargs)
    expected = {"tokens": TOKENS, "logits": logits(model, TOKENS).reshape(-1).tolist()}
    with open(f"{out}/expected.json", "w") as f:
        json.dump(expected, f)


def make(out):
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(
        GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=32, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0,
                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    perturb(gpt2)
    save(gpt2, f"{out}/gpt2")
    llama = LlamaForCausalLM(
        LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=96, max_position_embeddings=32, vocab_size=VOCAB, rms_norm_eps=1e-5,
                    rope_theta=10000.0, tie_word_embeddings=False))
    perturb(llama)
    save(llama, f"{out}/llama")
    scaling = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
    tied = LlamaForCausalLM(
        LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                    intermediate_size=96, max_position_embeddings=32, vocab_size=VOCAB, rms_norm_eps=1e-6,
                    rope_parameters=scaling, tie_word_embeddings=True))
    perturb(tied)
    save(tied, f"{out}/llama-tied", max_shard_size="40KB")


def main():
    if sys.argv[1] == "make":
        make(sys.argv[2])
    elif sys.argv[1] == "logits":
        model = (GPT2LMHeadModel if "gpt2" in open(f"{sys.argv[2]}/config.json").read() else LlamaForCausalLM)
        loaded = model.from_pretrained(sys.argv[2], dtype=torch.float32)
        tokens = json.loads(sys.argv[3])
        print(json.dumps(logits(loaded, tokens).reshape(-1).tolist()))
    elif sys.argv[1] == "peft":
        from peft import PeftModel
        base = LlamaForCausalLM.from_pretrained(sys.argv[2], dtype=torch.float32)
        adapted = PeftModel.from_pretrained(base, sys.argv[3])
        tokens = json.loads(sys.argv[4])
        print(json.dumps(logits(adapted, tokens).reshape(-1).tolist()))
    else:
        raise SystemExit(f"unknown command {sys.argv[1]}")


if __name__ == "__main__":
    main()
