//! GGUF tensor names and layouts → HF ones: the name map, llama's Q/K row permutation
//! undone, and gemma's stored `1 + w` norm weights turned back into `w`.

/// Which GGUF→HF tensor conventions an architecture uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorConventions {
    /// llama.cpp reorders q/k rows of llama-family models for its rotary layout.
    pub permuted_qk: bool,
    /// Gemma converters store norm weights as `1 + w`.
    pub norm_plus_one: bool,
    /// Gemma 2/3 have four norms per layer, named differently in GGUF.
    pub sandwich_norms: bool,
}

/// HF name of a GGUF tensor, or `None` for tensors HF checkpoints do not have.
pub fn hf_name(gguf: &str, conv: TensorConventions) -> Option<String> {
    let global = match gguf {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(name) = global {
        return Some(name.to_string());
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (module, suffix) = rest.rsplit_once('.')?;
    let hf_module = match module {
        "attn_norm" => "input_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        // Mixture of experts: the router, and every expert's projection stacked
        // `[experts, out, in]`, which dspec and mlx-lm read as `switch_mlp`.
        "ffn_gate_inp" => "mlp.gate",
        "ffn_gate_exps" => "mlp.switch_mlp.gate_proj",
        "ffn_up_exps" => "mlp.switch_mlp.up_proj",
        "ffn_down_exps" => "mlp.switch_mlp.down_proj",
        // Pre-norm families: the norm before the MLP is HF's post_attention_layernorm.
        "ffn_norm" if !conv.sandwich_norms => "post_attention_layernorm",
        "ffn_norm" => "pre_feedforward_layernorm",
        "post_attention_norm" => "post_attention_layernorm",
        "post_ffw_norm" => "post_feedforward_layernorm",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf_module}.{suffix}"))
}

/// Undoes llama.cpp's q/k permutation on a row-major `[rows, cols]` matrix (or a
/// bias, `cols == 1`) of `heads` heads. GGUF row `h·d + 2i + j` holds HF row
/// `h·d + j·d/2 + i` (d = head_dim): the two rotary halves interleaved.
pub fn unpermute_qk(data: &[f32], rows: usize, cols: usize, heads: usize) -> Vec<f32> {
    let head_dim = rows / heads.max(1);
    let half = head_dim / 2;
    let mut out = vec![0.0f32; data.len()];
    for h in 0..heads {
        for i in 0..half {
            for j in 0..2 {
                let src = (h * head_dim + 2 * i + j) * cols;
                let dst = (h * head_dim + j * half + i) * cols;
                out[dst..dst + cols].copy_from_slice(&data[src..src + cols]);
            }
        }
    }
    out
}

/// Whether a HF tensor is a norm weight (gemma stores these as `1 + w`).
pub fn is_norm_weight(hf: &str) -> bool {
    hf.ends_with("norm.weight")
}

#[cfg(test)]
mod tests {
    use super::*;

    const LLAMA: TensorConventions = TensorConventions {
        permuted_qk: true,
        norm_plus_one: false,
        sandwich_norms: false,
    };
    const GEMMA3: TensorConventions = TensorConventions {
        permuted_qk: false,
        norm_plus_one: true,
        sandwich_norms: true,
    };

    #[test]
    fn names_map_per_family_norm_layout() {
        assert_eq!(
            hf_name("blk.3.ffn_norm.weight", LLAMA).as_deref(),
            Some("model.layers.3.post_attention_layernorm.weight")
        );
        assert_eq!(
            hf_name("blk.3.ffn_norm.weight", GEMMA3).as_deref(),
            Some("model.layers.3.pre_feedforward_layernorm.weight")
        );
        assert_eq!(
            hf_name("blk.0.post_ffw_norm.weight", GEMMA3).as_deref(),
            Some("model.layers.0.post_feedforward_layernorm.weight")
        );
        assert_eq!(
            hf_name("blk.12.attn_q.bias", LLAMA).as_deref(),
            Some("model.layers.12.self_attn.q_proj.bias")
        );
        assert_eq!(
            hf_name("output.weight", LLAMA).as_deref(),
            Some("lm_head.weight")
        );
        assert_eq!(hf_name("rope_freqs.weight", LLAMA), None);
    }

    /// llama.cpp's permutation written independently: view rows as (head, half, i)
    /// and swap the last two axes, so GGUF row (h, i, half) = HF row (h, half, i).
    fn permute(hf: &[f32], rows: usize, cols: usize, heads: usize) -> Vec<f32> {
        let d = rows / heads;
        let mut out = Vec::with_capacity(hf.len());
        for h in 0..heads {
            for i in 0..d / 2 {
                for half in 0..2 {
                    let r = h * d + half * (d / 2) + i;
                    out.extend_from_slice(&hf[r * cols..(r + 1) * cols]);
                }
            }
        }
        out
    }

    #[test]
    fn unpermute_inverts_the_gguf_permutation() {
        let (heads, d, cols) = (3, 8, 5);
        let hf: Vec<f32> = (0..heads * d * cols).map(|x| x as f32).collect();
        let gguf = permute(&hf, heads * d, cols, heads);
        assert_ne!(gguf, hf);
        assert_eq!(unpermute_qk(&gguf, heads * d, cols, heads), hf);
        // Biases are the cols == 1 case.
        let bias: Vec<f32> = (0..heads * d).map(|x| x as f32).collect();
        assert_eq!(
            unpermute_qk(&permute(&bias, heads * d, 1, heads), heads * d, 1, heads),
            bias
        );
    }
}
