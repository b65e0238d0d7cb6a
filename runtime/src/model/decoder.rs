//! The decoder forward of every family moult implements, one [`CausalLm`]: Qwen3 and the
//! families that differ from it only by configuration (transformers' `modeling_qwen3.py`,
//! `modeling_qwen3_moe.py`, `modeling_qwen2.py`, `modeling_llama.py`, `modeling_mistral.py`,
//! `modeling_gemma3.py`), over a packed batch of variable-length sequences.
//!
//! Layer: `h += o_proj(attn(rope(q_norm(q)), rope(k_norm(k)), v))` on `input_layernorm(h)`, then
//! `h += mlp(post_attention_layernorm(h))`; RMSNorm computes in float32 and casts back. The q/k
//! norms are Qwen3's and Gemma 3's; projections carry biases where the config says
//! ([`ModelConfig`]). Gemma 3 adds a norm on each sublayer's output (its
//! `post_attention_layernorm` is that norm and `pre_feedforward_layernorm` the MLP's input norm),
//! scales norms by `1 + w`, scales the embedding, and gates with GeLU; its sliding layers attend
//! over a window with their own rope. Weight names are the checkpoint's
//! (`model.layers.3.self_attn.q_proj.weight`, `model.layers.0.mlp.experts.7.down_proj.weight`).
//! Qwen2.5-VL is Qwen2 with multimodal rotary positions and a vision tower whose output replaces
//! the embeddings of image placeholder tokens (`multimodal`, `super::vl`).

use std::collections::BTreeMap;
use std::path::Path;

use tch::{Device, Kind, Tensor};

use super::config::ModelConfig;
use super::kv_cache::KvCache;
use super::linear::Linear;
use super::loader::{load_safetensors_dir, WeightTaker};
use super::lora::{self, Adapter, LoraConfig, Part, Rows};
use super::mlp::gated_mlp;
use super::moe::{Expert, SparseMoe};
use super::rope::{Rope, RopeAt};
use super::vl::tower::VisionTower;
use super::vl::ImageInput;
use super::{Error, Result};
use crate::vision::ImageProcessorConfig;

mod attention;
mod multimodal;

use attention::{CachedBatch, Span};

/// One sequence's part of a packed forward.
#[derive(Debug)]
pub struct SeqInput<'a> {
    /// The tokens to run, following whatever the sequence's cache slot already holds.
    pub tokens: &'a [i64],
    /// The sequence's slot in the [`KvCache`] passed to [`CausalLm::forward`]: read as the
    /// prefix and extended with `tokens`. `None` (with no cache) runs the tokens from position 0
    /// (the trainer's path).
    pub slot: Option<usize>,
    /// Routing to replay for MoE layers: `[tokens.len(), sparse_layers, top_k]` expert ids.
    pub replay: Option<&'a Tensor>,
    /// The sequence's images (vision-language models; `&[]` for text), every one of the whole
    /// sequence on every call, also those before or after `tokens`: they give the positions of
    /// the tokens after them. Made by [`CausalLm::place_images`] (docs/vision.md).
    pub images: &'a [ImageInput],
}

/// Which positions get logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsFor<'a> {
    /// Every token of every sequence, in packed order.
    All,
    /// Only each sequence's last token (decoding).
    Last,
    /// These rows of the packed batch, in this order (decoding that also scores prompt tokens).
    Rows(&'a [i64]),
}

#[derive(Debug)]
pub struct ForwardOutput {
    /// `[rows, vocab]` in the model's dtype; rows per [`LogitsFor`].
    pub logits: Tensor,
    /// For MoE models: `[total tokens, sparse layers, top_k]` int64 expert ids, packed order.
    pub routed_experts: Option<Tensor>,
}

#[derive(Debug)]
enum Mlp {
    Dense {
        /// `gate_proj` and `up_proj` stacked: one matmul instead of two.
        gate_up_proj: Linear,
        down_proj: Linear,
    },
    Sparse(SparseMoe),
}

#[derive(Debug)]
struct Layer {
    input_layernorm: Tensor,
    /// The MLP's input norm: `post_attention_layernorm`, Gemma's `pre_feedforward_layernorm`.
    mlp_norm: Tensor,
    /// Gemma's norms of the attention's and the MLP's outputs (`post_attention_layernorm`,
    /// `post_feedforward_layernorm`).
    attn_out_norm: Option<Tensor>,
    mlp_out_norm: Option<Tensor>,
    /// Attends over the last `sliding_window` positions only (when the config's window slides).
    window: Option<i64>,
    /// Rotates with the model's `sliding_rope` (Gemma 3's local layers).
    local_rope: bool,
    /// `q_proj`, `k_proj` and `v_proj` stacked: one matmul instead of three.
    qkv_proj: Linear,
    o_proj: Linear,
    /// Qwen3's per-head RMSNorms of queries and keys; `None` for the other families.
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
    mlp: Mlp,
}

impl Layer {
    /// The tensors that own this layer's weights, in [`CausalLm::trainable`] order.
    fn tensors(&self) -> impl Iterator<Item = &Tensor> {
        let mlp: Vec<&Tensor> = match &self.mlp {
            Mlp::Dense {
                gate_up_proj,
                down_proj,
            } => gate_up_proj.tensors().chain(down_proj.tensors()).collect(),
            Mlp::Sparse(moe) => std::iter::once(&moe.gate)
                .chain(
                    moe.experts
                        .iter()
                        .flat_map(|e| [&e.gate_up_proj.weight, &e.down_proj.weight]),
                )
                .collect(),
        };
        [&self.input_layernorm, &self.mlp_norm]
            .into_iter()
            .chain(self.attn_out_norm.as_ref())
            .chain(self.mlp_out_norm.as_ref())
            .chain(self.q_norm.as_ref())
            .chain(self.k_norm.as_ref())
            .chain(self.qkv_proj.tensors())
            .chain(self.o_proj.tensors())
            .chain(mlp)
    }

    /// The linears an adapter may target, in a fixed order: q/k/v, o, then the MLP's (each
    /// expert's in turn), each with the modules it stacks as (name, `in`, rows), `p` being the
    /// layer's name prefix (`model.layers.3`).
    fn adaptable(&mut self, p: &str, c: &ModelConfig) -> Vec<(&mut Linear, Vec<lora::Module>)> {
        let (h, d) = (c.hidden_size as i64, c.head_dim as i64);
        let (q, kv) = (
            c.num_attention_heads as i64 * d,
            c.num_key_value_heads as i64 * d,
        );
        let gated = |q: &str, i: i64| {
            [
                vec![
                    (format!("{q}.gate_proj"), h, i),
                    (format!("{q}.up_proj"), h, i),
                ],
                vec![(format!("{q}.down_proj"), i, h)],
            ]
        };
        let a = format!("{p}.self_attn");
        let mut out = vec![
            (
                &mut self.qkv_proj,
                vec![
                    (format!("{a}.q_proj"), h, q),
                    (format!("{a}.k_proj"), h, kv),
                    (format!("{a}.v_proj"), h, kv),
                ],
            ),
            (&mut self.o_proj, vec![(format!("{a}.o_proj"), q, h)]),
        ];
        match &mut self.mlp {
            Mlp::Dense {
                gate_up_proj,
                down_proj,
            } => {
                let [gu, down] = gated(&format!("{p}.mlp"), c.intermediate_size as i64);
                out.extend([(gate_up_proj, gu), (down_proj, down)]);
            }
            Mlp::Sparse(moe) => {
                let i = c.moe.as_ref().map_or(0, |m| m.moe_intermediate_size as i64);
                for (e, expert) in moe.experts.iter_mut().enumerate() {
                    let [gu, down] = gated(&format!("{p}.mlp.experts.{e}"), i);
                    out.extend([
                        (&mut expert.gate_up_proj, gu),
                        (&mut expert.down_proj, down),
                    ]);
                }
            }
        }
        out
    }

    /// The adapters' tensors of this layer, in [`Layer::adaptable`] order.
    fn adapter_tensors(&self) -> impl Iterator<Item = &Tensor> {
        let mlp: Vec<&Linear> = match &self.mlp {
            Mlp::Dense {
                gate_up_proj,
                down_proj,
            } => vec![gate_up_proj, down_proj],
            Mlp::Sparse(moe) => moe
                .experts
                .iter()
                .flat_map(|e| [&e.gate_up_proj, &e.down_proj])
                .collect(),
        };
        [&self.qkv_proj, &self.o_proj]
            .into_iter()
            .chain(mlp)
            .filter_map(|l| l.adapters.first().and_then(Option::as_ref))
            .flat_map(Adapter::tensors)
    }
}

/// Where a checkpoint-named weight lies in [`CausalLm::trainable`] ([`CausalLm::named_slices`]).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct NamedSlice {
    pub name: String,
    /// Index into [`CausalLm::trainable`].
    pub tensor: usize,
    /// First element within the flattened tensor.
    pub offset: i64,
    pub shape: Vec<i64>,
}

/// A loaded causal LM of an implemented family (Qwen3, Qwen3-MoE, Qwen2, Llama, Mistral, Gemma 3,
/// and Qwen2.5-VL with its vision tower).
#[derive(Debug)]
pub struct CausalLm {
    cfg: ModelConfig,
    /// Every weight by checkpoint name. Each is the layer's tensor or a view into a stacked one
    /// (`q_proj` is rows of `qkv_proj`), sharing storage: an in-place update here is what the
    /// forward sees.
    params: BTreeMap<String, Tensor>,
    embed_tokens: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Linear,
    rope: Rope,
    /// Gemma 3's local layers' rope.
    sliding_rope: Option<Rope>,
    /// Qwen2.5-VL's vision tower (`visual.*`).
    vision: Option<VisionTower>,
    /// The vision tower runs without gradient ([`CausalLm::freeze_vision`]).
    vision_frozen: bool,
    /// The model folder's `preprocessor_config.json`, for a vision-language model that has one.
    image_processor: Option<ImageProcessorConfig>,
    /// The LoRA adapter every forward adds ([`CausalLm::attach_lora`]), slot 0.
    lora: Option<LoraConfig>,
    /// Adapters served beside it, by slot ([`CausalLm::load_adapter`]).
    loaded: BTreeMap<usize, LoraConfig>,
    kind: Kind,
    device: Device,
}

/// `x / sqrt(mean(x²) + eps) * weight` over the last dimension, accumulated in float32
/// (libtorch's fused kernel; transformers' `Qwen3RMSNorm` computes the same).
fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Tensor {
    x.rms_norm([x.size()[x.dim() - 1]], Some(weight), eps)
}

/// Gemma's RMSNorm: `x / sqrt(mean(x²) + eps) * (1 + weight)`, all in float32, cast back.
fn rms_norm_offset(x: &Tensor, weight: &Tensor, eps: f64) -> Tensor {
    let scale = weight.to_kind(Kind::Float) + 1.0;
    rms_norm(&x.to_kind(Kind::Float), &scale, eps).to_kind(x.kind())
}

impl CausalLm {
    /// Loads `config.json` and the safetensors weights of a model folder.
    /// A vision-language model also reads the folder's `preprocessor_config.json` when there
    /// is one ([`CausalLm::image_processor`]).
    /// A LoRA adapter folder (`adapter_config.json`, docs/lora.md) loads its base model and
    /// attaches the adapter ([`CausalLm::attach_lora`]).
    pub fn load(dir: &Path, kind: Kind, device: Device) -> Result<Self> {
        Self::load_lora(dir, None, kind, device)
    }

    /// [`CausalLm::load`], with a new LoRA adapter of shape `lora` attached (from seed 0) when
    /// the folder brings none.
    pub fn load_lora(
        dir: &Path,
        lora: Option<&LoraConfig>,
        kind: Kind,
        device: Device,
    ) -> Result<Self> {
        if let Some(config) = lora.filter(|_| !lora::is_adapter(dir)) {
            let mut model = Self::load(dir, kind, device)?;
            model.attach_lora(config, None, 0)?;
            return Ok(model);
        }
        if lora::is_adapter(dir) {
            let (config, base, weights) = lora::read_adapter(dir, kind, device)?;
            if lora::is_adapter(&base) {
                let message = "names another adapter as its base model".into();
                return Err(Error::Checkpoint {
                    path: base,
                    message,
                });
            }
            let mut model = Self::load(&base, kind, device)?;
            model.attach_lora(&config, Some(weights), 0)?;
            return Ok(model);
        }
        let cfg = ModelConfig::from_dir(dir)?;
        let weights = load_safetensors_dir(dir, kind, device)?;
        let mut model = Self::from_weights(cfg, weights, kind, device)?;
        model.read_image_processor(dir)?;
        Ok(model)
    }

    /// Builds the model from named weights (checkpoint names).
    pub fn from_weights(
        cfg: ModelConfig,
        weights: BTreeMap<String, Tensor>,
        kind: Kind,
        device: Device,
    ) -> Result<Self> {
        let c = &cfg;
        let (h, d) = (c.hidden_size, c.head_dim);
        let (q_dim, kv_dim) = (c.num_attention_heads * d, c.num_key_value_heads * d);
        let mut w = WeightTaker::new(weights);
        let embed_tokens = w.take("model.embed_tokens.weight", &[c.vocab_size, h])?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for l in 0..c.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let mlp = if c.is_sparse_layer(l) {
                let moe = c.moe.as_ref().expect("sparse layers imply a MoE config");
                let i = moe.moe_intermediate_size;
                let experts = (0..moe.num_experts)
                    .map(|e| {
                        let q = format!("{p}.mlp.experts.{e}");
                        Ok(Expert {
                            gate_up_proj: Linear::new(w.take_stacked(&[
                                (format!("{q}.gate_proj.weight"), [i, h]),
                                (format!("{q}.up_proj.weight"), [i, h]),
                            ])?),
                            down_proj: Linear::new(
                                w.take(&format!("{q}.down_proj.weight"), &[h, i])?,
                            ),
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                Mlp::Sparse(SparseMoe {
                    gate: w.take(&format!("{p}.mlp.gate.weight"), &[moe.num_experts, h])?,
                    experts,
                    top_k: moe.num_experts_per_tok as i64,
                    norm_topk_prob: moe.norm_topk_prob,
                })
            } else {
                let i = c.intermediate_size;
                let mlp_bias = c.mlp_bias;
                Mlp::Dense {
                    gate_up_proj: Linear::with_bias(
                        w.take_stacked(&[
                            (format!("{p}.mlp.gate_proj.weight"), [i, h]),
                            (format!("{p}.mlp.up_proj.weight"), [i, h]),
                        ])?,
                        w.take_stacked_if(
                            mlp_bias,
                            &[
                                (format!("{p}.mlp.gate_proj.bias"), [i]),
                                (format!("{p}.mlp.up_proj.bias"), [i]),
                            ],
                        )?,
                    ),
                    down_proj: Linear::with_bias(
                        w.take(&format!("{p}.mlp.down_proj.weight"), &[h, i])?,
                        w.take_if(mlp_bias, &format!("{p}.mlp.down_proj.bias"), &[h])?,
                    ),
                }
            };
            let attn = format!("{p}.self_attn");
            let mut norm = |name: &str| w.take(&format!("{p}.{name}.weight"), &[h]);
            let input_layernorm = norm("input_layernorm")?;
            // Gemma's sandwich renames the MLP's input norm and adds two output norms.
            let (mlp_norm, attn_out_norm, mlp_out_norm) = if c.sandwich_norms {
                (
                    norm("pre_feedforward_layernorm")?,
                    Some(norm("post_attention_layernorm")?),
                    Some(norm("post_feedforward_layernorm")?),
                )
            } else {
                (norm("post_attention_layernorm")?, None, None)
            };
            let sliding = c.sliding_layers[l];
            layers.push(Layer {
                input_layernorm,
                mlp_norm,
                attn_out_norm,
                mlp_out_norm,
                window: c.sliding_window.filter(|_| sliding).map(|w| w as i64),
                local_rope: sliding && c.sliding_rope.is_some(),
                qkv_proj: Linear::with_bias(
                    w.take_stacked(&[
                        (format!("{attn}.q_proj.weight"), [q_dim, h]),
                        (format!("{attn}.k_proj.weight"), [kv_dim, h]),
                        (format!("{attn}.v_proj.weight"), [kv_dim, h]),
                    ])?,
                    w.take_stacked_if(
                        c.qkv_bias,
                        &[
                            (format!("{attn}.q_proj.bias"), [q_dim]),
                            (format!("{attn}.k_proj.bias"), [kv_dim]),
                            (format!("{attn}.v_proj.bias"), [kv_dim]),
                        ],
                    )?,
                ),
                o_proj: Linear::with_bias(
                    w.take(&format!("{attn}.o_proj.weight"), &[h, q_dim])?,
                    w.take_if(c.o_bias, &format!("{attn}.o_proj.bias"), &[h])?,
                ),
                q_norm: w.take_if(c.qk_norm, &format!("{attn}.q_norm.weight"), &[d])?,
                k_norm: w.take_if(c.qk_norm, &format!("{attn}.k_norm.weight"), &[d])?,
                mlp,
            });
        }
        let vision = match &c.vl {
            Some(vl) if vl.vision.out_hidden_size != h => {
                return Err(Error::Config(format!(
                    "`vision_config.out_hidden_size` ({}) must be the text model's `hidden_size` ({h}): the merger's output replaces token embeddings",
                    vl.vision.out_hidden_size
                )))
            }
            Some(vl) => Some(VisionTower::load(&vl.vision, &mut w)?),
            None => None,
        };
        let norm = w.take("model.norm.weight", &[h])?;
        let lm_head = Linear::new(if c.tie_word_embeddings {
            // transformers may also save the tied copy; the embedding is the one that counts.
            w.map.remove("lm_head.weight");
            embed_tokens.shallow_clone()
        } else {
            w.take("lm_head.weight", &[c.vocab_size, h])?
        });
        if let Some(extra) = w.map.keys().next() {
            return Err(Error::Weight {
                name: extra.clone(),
                message: format!(
                    "is in the checkpoint but not used by {:?} ({} unused weights in all); the checkpoint and config.json disagree",
                    c.architecture,
                    w.map.len()
                ),
            });
        }
        let rope = Rope::new(d, c.rope, c.max_position_embeddings, kind, device);
        let sliding_rope = c
            .sliding_rope
            .map(|r| Rope::new(d, r, c.max_position_embeddings, kind, device));
        Ok(Self {
            cfg,
            params: w.taken,
            embed_tokens,
            layers,
            norm,
            lm_head,
            rope,
            sliding_rope,
            vision,
            vision_frozen: false,
            image_processor: None,
            lora: None,
            loaded: BTreeMap::new(),
            kind,
            device,
        })
    }

    /// Adds a LoRA adapter to every module `config` targets (docs/lora.md): `weights` by PEFT
    /// name (every targeted module's `A` and `B`, nothing else), or a new adapter from `seed`
    /// (PEFT's initialisation: the model computes as before). From then on the model *is* its
    /// adapter: [`CausalLm::params`], [`CausalLm::trainable`] and the names of
    /// [`CausalLm::named_slices`] are the adapter's tensors, under PEFT's names, and the base
    /// weights stay as they are, frozen and shared. Vision towers are not adapted.
    pub fn attach_lora(
        &mut self,
        config: &LoraConfig,
        weights: Option<BTreeMap<String, Tensor>>,
        seed: u64,
    ) -> Result<()> {
        if self.lora.is_some() {
            return Err(Error::Config("the model already has a LoRA adapter".into()));
        }
        self.params = self.install(0, config, weights, seed)?;
        self.lora = Some(config.clone());
        Ok(())
    }

    /// Serves the adapter `weights` (PEFT names) of shape `config` in slot `slot` (1 and up;
    /// slot 0 is the model's own, [`CausalLm::attach_lora`]), beside the model's weights: a
    /// sequence asks for it by slot ([`CausalLm::forward_adapters`]). Replaces what the slot
    /// held. Nothing is installed when the adapter does not fit the model.
    pub fn load_adapter(
        &mut self,
        slot: usize,
        config: &LoraConfig,
        weights: BTreeMap<String, Tensor>,
    ) -> Result<()> {
        if slot == 0 {
            return Err(Error::Config("adapter slot 0 is the model's own".into()));
        }
        self.install(slot, config, Some(weights), 0)?;
        self.loaded.insert(slot, config.clone());
        Ok(())
    }

    /// Empties slot `slot` ([`CausalLm::load_adapter`]).
    pub fn drop_adapter(&mut self, slot: usize) {
        for layer in &mut self.layers {
            for (linear, _) in layer.adaptable("", &self.cfg) {
                linear.set_adapter(slot, None);
            }
        }
        self.loaded.remove(&slot);
    }

    /// Puts an adapter in slot `slot` of every linear `config` targets: `weights` by PEFT name
    /// (every tensor used, shapes checked), or a new one from `seed`. Returns the adapter's
    /// tensors by name. On an error no linear has changed.
    fn install(
        &mut self,
        slot: usize,
        config: &LoraConfig,
        weights: Option<BTreeMap<String, Tensor>>,
        seed: u64,
    ) -> Result<BTreeMap<String, Tensor>> {
        config.check()?;
        let (r, scale, kind, device) = (config.rank, config.scale(), self.kind, self.device);
        let dropout = config.dropout;
        let mut targeted = Vec::new();
        let mut linears = Vec::new();
        for (l, layer) in self.layers.iter_mut().enumerate() {
            for (linear, modules) in layer.adaptable(&format!("model.layers.{l}"), &self.cfg) {
                let mut start = 0;
                let mut parts = Vec::new();
                for (module, fan_in, rows) in modules {
                    if config.adapts(&module) {
                        targeted.push((module.clone(), fan_in, rows));
                        parts.push((module, start, fan_in, rows));
                    }
                    start += rows;
                }
                linears.push((linear, parts));
            }
        }
        // As in PEFT, a targeted module an adapter file has no tensors for is not adapted.
        let weights = match weights {
            Some(w) => {
                let has = |m: &String| {
                    w.contains_key(&lora::peft_name(m, 'A'))
                        || w.contains_key(&lora::peft_name(m, 'B'))
                };
                for (_, parts) in &mut linears {
                    parts.retain(|(module, ..)| has(module));
                }
                w
            }
            None => lora::init(config, &targeted, seed, kind, device),
        };
        let mut w = WeightTaker::new(weights);
        let mut adapters = Vec::new();
        for (linear, parts) in linears {
            let parts = parts
                .into_iter()
                .map(|(module, start, fan_in, rows)| {
                    let a = w.take(
                        &lora::peft_name(&module, 'A'),
                        &[r as usize, fan_in as usize],
                    )?;
                    let b = w.take(&lora::peft_name(&module, 'B'), &[rows as usize, r as usize])?;
                    Ok(Part { start, rows, a, b })
                })
                .collect::<Result<Vec<_>>>()?;
            let adapter = (!parts.is_empty()).then_some(Adapter {
                parts,
                scale,
                dropout,
            });
            adapters.push((linear, adapter));
        }
        if let Some(extra) = w.map.keys().next() {
            return Err(Error::Weight {
                name: extra.clone(),
                message: format!(
                    "is in the adapter but names no module of the model its target_modules ({}) select",
                    config.targets.join(", ")
                ),
            });
        }
        for (linear, adapter) in adapters {
            linear.set_adapter(slot, adapter);
        }
        Ok(w.taken)
    }

    /// The LoRA adapter the model computes with, if any ([`CausalLm::attach_lora`]).
    pub fn lora(&self) -> Option<&LoraConfig> {
        self.lora.as_ref()
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The family's RMSNorm of `x` with `weight`.
    fn rms(&self, x: &Tensor, weight: &Tensor) -> Tensor {
        if self.cfg.norm_weight_offset {
            rms_norm_offset(x, weight, self.cfg.rms_norm_eps)
        } else {
            rms_norm(x, weight, self.cfg.rms_norm_eps)
        }
    }

    pub fn kind(&self) -> Kind {
        self.kind
    }

    pub fn device(&self) -> Device {
        self.device
    }

    /// Every weight by checkpoint name (shallow clones: writing into one updates the model).
    pub fn params(&self) -> &BTreeMap<String, Tensor> {
        &self.params
    }

    /// The tensors that own the weights' storage, each once: what an optimizer updates. Stacked
    /// projections appear as their stacks (the checkpoint names of [`CausalLm::params`] are
    /// views into them), a tied LM head once. A vision tower's tensors come last, frozen or not
    /// ([`CausalLm::freeze_vision`]).
    /// With a LoRA adapter, the adapter's tensors only (each layer's in turn).
    pub fn trainable(&self) -> Vec<Tensor> {
        if self.lora.is_some() {
            return self
                .layers
                .iter()
                .flat_map(Layer::adapter_tensors)
                .map(Tensor::shallow_clone)
                .collect();
        }
        let mut out = vec![self.embed_tokens.shallow_clone(), self.norm.shallow_clone()];
        for l in &self.layers {
            out.extend(l.tensors().map(Tensor::shallow_clone));
        }
        if let Some(head) = self.untied_head() {
            out.push(head.shallow_clone());
        }
        if let Some(vision) = &self.vision {
            out.extend(vision.tensors().into_iter().map(Tensor::shallow_clone));
        }
        out
    }

    /// [`CausalLm::trainable`] in groups, as ranges of its indices: the embedding, the final
    /// norm, each decoder layer in order, the LM head when it is not tied to the embedding, then
    /// the vision tower, whole, as one unit ([`CausalLm::vision_unit`]). With a LoRA adapter,
    /// each layer's adapter tensors.
    pub fn trainable_units(&self) -> Vec<std::ops::Range<usize>> {
        if self.lora.is_some() {
            let mut at = 0;
            return self
                .layers
                .iter()
                .map(|l| {
                    let n = l.adapter_tensors().count();
                    at += n;
                    at - n..at
                })
                .collect();
        }
        let mut units = vec![0..1, 1..2];
        let mut at = 2;
        for l in &self.layers {
            let n = l.tensors().count();
            units.push(at..at + n);
            at += n;
        }
        if self.untied_head().is_some() {
            units.push(at..at + 1);
            at += 1;
        }
        if let Some(vision) = &self.vision {
            units.push(at..at + vision.tensors().len());
        }
        units
    }

    fn untied_head(&self) -> Option<&Tensor> {
        (self.lm_head.weight.data_ptr() != self.embed_tokens.data_ptr())
            .then_some(&self.lm_head.weight)
    }

    /// Where each weight of [`CausalLm::params`] lies in [`CausalLm::trainable`]: the tensor, and
    /// the element range of its flattened form (a checkpoint name is a run of rows of a stack).
    pub fn named_slices(&self) -> Vec<NamedSlice> {
        let owners = self.trainable();
        self.params
            .iter()
            .map(|(name, view)| {
                let size = view.kind().elt_size_in_bytes() as i64;
                let at = view.data_ptr() as i64;
                let (tensor, offset) = owners
                    .iter()
                    .enumerate()
                    .find_map(|(i, t)| {
                        let start = t.data_ptr() as i64;
                        let bytes = t.numel() as i64 * size;
                        (at >= start && at < start + bytes).then(|| (i, (at - start) / size))
                    })
                    .expect("every named weight views a trainable tensor");
                NamedSlice {
                    name: name.clone(),
                    tensor,
                    offset,
                    shape: view.size(),
                }
            })
            .collect()
    }

    /// Computes in `kind` from now on (its rotary tables and scales): for a trainer that
    /// gathers its weights in `kind` while it keeps float32 shards (docs/distributed.md,
    /// "bfloat16 compute"). The weights themselves are the caller's to convert.
    pub fn compute_in(&mut self, kind: Kind) {
        let c = &self.cfg;
        self.rope = Rope::new(
            c.head_dim,
            c.rope,
            c.max_position_embeddings,
            kind,
            self.device,
        );
        self.sliding_rope = c
            .sliding_rope
            .map(|r| Rope::new(c.head_dim, r, c.max_position_embeddings, kind, self.device));
        self.kind = kind;
    }

    /// Drops the checkpoint-named views, keeping the weights only in the tensors
    /// [`CausalLm::trainable`] returns: a trainer that shards its weights frees those tensors'
    /// storage between uses, and a view would keep it alive. [`CausalLm::params`] is empty after.
    pub fn forget_names(&mut self) {
        self.params.clear();
    }

    /// Keeps oneDNN-packed copies of the attention, MLP and LM-head weights for inference on
    /// CPU (see [`Linear`]); returns whether it did (CPU and float32/bfloat16 only). Call
    /// [`CausalLm::refresh_packed`] after writing into [`CausalLm::params`].
    pub fn pack_for_inference(&mut self) -> bool {
        if self.device != Device::Cpu || !matches!(self.kind, Kind::Float | Kind::BFloat16) {
            return false;
        }
        for linear in self.dense_linears() {
            linear.pack();
        }
        true
    }

    /// Re-packs the packed weights from the dense ones (after a weight update), in place.
    /// With a LoRA adapter the updates write the adapter only, and the base stays packed as
    /// it is.
    pub fn refresh_packed(&mut self) {
        if self.lora.is_some() {
            return;
        }
        for linear in self.dense_linears() {
            linear.refresh();
        }
    }

    /// The linears worth packing: every one but the MoE experts and routers, whose matmuls see
    /// only the few tokens routed to them.
    fn dense_linears(&mut self) -> impl Iterator<Item = &mut Linear> {
        self.layers
            .iter_mut()
            .flat_map(|l| {
                let mlp: Vec<&mut Linear> = match &mut l.mlp {
                    Mlp::Dense {
                        gate_up_proj,
                        down_proj,
                    } => vec![gate_up_proj, down_proj],
                    Mlp::Sparse(_) => Vec::new(),
                };
                [&mut l.qkv_proj, &mut l.o_proj].into_iter().chain(mlp)
            })
            .chain(std::iter::once(&mut self.lm_head))
    }

    /// An empty KV cache shaped for this model, with `capacity` positions per slot reserved.
    pub fn new_cache(&self, capacity: usize) -> KvCache {
        KvCache::new(
            self.cfg.num_hidden_layers,
            self.cfg.num_key_value_heads,
            self.cfg.head_dim,
            capacity,
            self.kind,
            self.device,
        )
    }

    /// Runs a packed batch. Each sequence's new tokens attend to its cached prefix (if it has a
    /// slot in `cache`) and to each other causally; sequences never see each other.
    pub fn forward(
        &self,
        seqs: &[SeqInput<'_>],
        cache: Option<&mut KvCache>,
        logits_for: LogitsFor<'_>,
    ) -> Result<ForwardOutput> {
        self.forward_adapters(seqs, &[], cache, logits_for)
    }

    /// [`CausalLm::forward`], each sequence with the adapter `adapters` gives it: `Some(slot)`
    /// a slot of [`CausalLm::load_adapter`], `None` (or an empty `adapters`) the model's own
    /// (its attached adapter, or the base). One forward computes them all: each adapter adds
    /// its output on its sequences' rows.
    pub fn forward_adapters(
        &self,
        seqs: &[SeqInput<'_>],
        adapters: &[Option<usize>],
        mut cache: Option<&mut KvCache>,
        logits_for: LogitsFor<'_>,
    ) -> Result<ForwardOutput> {
        let packed = self.pack(seqs, adapters, cache.as_deref())?;
        let batch = match cache.as_deref_mut() {
            Some(cache) => {
                cache.reserve(
                    packed
                        .spans
                        .iter()
                        .map(|s| (s.past + s.n) as usize)
                        .max()
                        .unwrap_or(0),
                );
                Some(CachedBatch::new(
                    cache,
                    &packed.spans,
                    packed.token_slots.clone(),
                    self.cfg.sliding_window.map(|w| w as i64),
                    self.kind,
                    self.device,
                ))
            }
            None => None,
        };
        let ropes = self.ropes(&packed);
        let mut h = self.embed_packed(&packed);
        let mut routed = Vec::new();
        for l in 0..self.layers.len() {
            let on_cache = match (cache.as_deref_mut(), &batch) {
                (Some(cache), Some(batch)) => Some((cache, batch)),
                _ => None,
            };
            let replay = packed.layer_replay(self.sparse_index(l));
            let (out, experts) =
                self.layer_step(l, &h, &packed, &ropes, on_cache, replay.as_ref())?;
            h = out;
            routed.extend(experts);
        }
        if let Some(cache) = cache {
            for span in &packed.spans {
                cache.advance(span.slot.expect("checked above"), span.n as usize);
            }
        }
        let h = match logits_for {
            LogitsFor::All => h,
            LogitsFor::Last => h.index_select(
                0,
                &Tensor::from_slice(&packed.last_rows).to_device(self.device),
            ),
            LogitsFor::Rows(rows) => {
                h.index_select(0, &Tensor::from_slice(rows).to_device(self.device))
            }
        };
        let routed_experts = (!routed.is_empty()).then(|| Tensor::stack(&routed, 1));
        Ok(ForwardOutput {
            logits: self.head(&h),
            routed_experts,
        })
    }

    /// The trainer's forward (no cache), one stage at a time: see [`Stages`].
    pub fn stages(&self, seqs: &[SeqInput<'_>]) -> Result<Stages<'_>> {
        let packed = self.pack(seqs, &[], None)?;
        let ropes = self.ropes(&packed);
        Ok(Stages {
            model: self,
            packed,
            ropes,
        })
    }

    /// Checks a batch and lays it out packed.
    fn pack(
        &self,
        seqs: &[SeqInput<'_>],
        adapters: &[Option<usize>],
        cache: Option<&KvCache>,
    ) -> Result<Packed> {
        let c = &self.cfg;
        if !adapters.is_empty() && adapters.len() != seqs.len() {
            return Err(Error::Input(format!(
                "{} adapters for {} sequences",
                adapters.len(),
                seqs.len()
            )));
        }
        if let Some(slot) = adapters
            .iter()
            .flatten()
            .find(|s| !self.loaded.contains_key(s))
        {
            return Err(Error::Input(format!(
                "adapter slot {slot} holds no adapter"
            )));
        }
        let own = self.lora.as_ref().map(|_| 0);
        let mut adapter_rows = Vec::new();
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        let mut token_slots = Vec::new();
        let mut last_rows = Vec::with_capacity(seqs.len());
        let mut spans = Vec::with_capacity(seqs.len());
        for seq in seqs {
            let n = seq.tokens.len();
            if n == 0 {
                return Err(Error::Input(
                    "a sequence in the batch has no tokens to run".into(),
                ));
            }
            if let Some(&bad) = seq
                .tokens
                .iter()
                .find(|&&t| t < 0 || t as usize >= c.vocab_size)
            {
                return Err(Error::Input(format!(
                    "token id {bad} is outside the vocabulary (size {})",
                    c.vocab_size
                )));
            }
            let past = match (seq.slot, cache) {
                (None, None) => 0,
                (Some(slot), Some(cache)) if slot < cache.used() => cache.len(slot),
                (Some(slot), Some(_)) => {
                    return Err(Error::Input(format!("cache slot {slot} is not allocated")))
                }
                (Some(_), None) => {
                    return Err(Error::Input(
                        "a sequence has a cache slot but no cache was given".into(),
                    ))
                }
                (None, Some(_)) => {
                    return Err(Error::Input(
                        "with a cache, every sequence needs a slot".into(),
                    ))
                }
            };
            if past + n > self.rope.max_positions() {
                return Err(Error::Input(format!(
                    "{} positions exceed max_position_embeddings {}",
                    past + n,
                    self.rope.max_positions()
                )));
            }
            spans.push(Span {
                offset: ids.len() as i64,
                n: n as i64,
                past: past as i64,
                slot: seq.slot,
            });
            self.check_images(seq, past)?;
            ids.extend_from_slice(seq.tokens);
            positions.extend((past..past + n).map(|p| p as i64));
            token_slots.extend(std::iter::repeat_n(seq.slot.unwrap_or(0) as i64, n));
            let adapter = adapters.get(spans.len() - 1).copied().flatten().or(own);
            adapter_rows.extend(std::iter::repeat_n(adapter, n));
            last_rows.push(ids.len() as i64 - 1);
        }
        let replay = self.packed_replay(seqs, ids.len())?;
        let (mrope, images) = self.pack_images(seqs, &spans);
        Ok(Packed {
            ids: Tensor::from_slice(&ids).to_device(self.device),
            positions: Tensor::from_slice(&positions).to_device(self.device),
            token_slots,
            last_rows,
            spans,
            replay,
            mrope,
            images,
            adapters: Rows::new(adapter_rows, self.device),
        })
    }

    /// The rotations of a batch: the model's (at multimodal positions when a sequence has
    /// images), and Gemma 3's local layers'.
    fn ropes(&self, packed: &Packed) -> (RopeAt, Option<RopeAt>) {
        let positions = &packed.positions;
        let rope = match (&packed.mrope, &self.cfg.vl) {
            (Some(mrope), Some(vl)) => self.rope.at_mrope(mrope, vl.mrope_section),
            _ => self.rope.at(positions),
        };
        (rope, self.sliding_rope.as_ref().map(|r| r.at(positions)))
    }

    /// The embeddings of `ids` (scaled where the family scales them).
    fn embed(&self, ids: &Tensor) -> Tensor {
        let h = self.embed_tokens.index_select(0, ids);
        match self.cfg.embed_scale {
            // transformers rounds the scale to the weights' dtype first.
            Some(scale) => {
                h * Tensor::from(scale as f32)
                    .to_kind(self.kind)
                    .to_device(self.device)
            }
            None => h,
        }
    }

    /// Which of the sparse layers layer `l` is (its index into routing tensors).
    fn sparse_index(&self, l: usize) -> usize {
        (0..l).filter(|&i| self.cfg.is_sparse_layer(i)).count()
    }

    /// Decoder layer `l` on `h`; a sparse layer replays `replay` (`[tokens, top_k]`) when given
    /// and returns the experts it used.
    // `h += x` on a tch Tensor is in place, and autograd needs the pre-residual `h` the norms
    // saved; the residual adds stay out of place.
    #[allow(clippy::assign_op_pattern)]
    fn layer_step(
        &self,
        l: usize,
        h: &Tensor,
        packed: &Packed,
        (rope, sliding_rope): &(RopeAt, Option<RopeAt>),
        cache: Option<(&mut KvCache, &CachedBatch)>,
        replay: Option<&Tensor>,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let c = &self.cfg;
        let layer = &self.layers[l];
        let x = self.rms(h, &layer.input_layernorm);
        let rope: &RopeAt = match sliding_rope {
            Some(local) if layer.local_rope => local,
            _ => rope,
        };
        let attn = match cache {
            Some((cache, batch)) => self.attention_cached(
                l,
                layer,
                &x,
                rope,
                &packed.positions,
                cache,
                batch,
                &packed.spans,
                &packed.adapters,
            ),
            None => self.attention_uncached(layer, &x, rope, &packed.spans, &packed.adapters),
        };
        let attn = match &layer.attn_out_norm {
            Some(w) => self.rms(&attn, w),
            None => attn,
        };
        let h = h + attn;
        let x = self.rms(&h, &layer.mlp_norm);
        let (mlp_out, experts) = match &layer.mlp {
            Mlp::Dense {
                gate_up_proj,
                down_proj,
            } => {
                let out = gated_mlp(&x, gate_up_proj, down_proj, c.activation, &packed.adapters);
                (out, None)
            }
            Mlp::Sparse(moe) => {
                let (out, experts) = moe.forward(&x, replay, &packed.adapters)?;
                (out, Some(experts))
            }
        };
        let mlp_out = match &layer.mlp_out_norm {
            Some(w) => self.rms(&mlp_out, w),
            None => mlp_out,
        };
        Ok((h + mlp_out, experts))
    }

    /// The final norm, the LM head and the family's soft cap: logits of the rows `h`.
    fn head(&self, h: &Tensor) -> Tensor {
        let logits = self.lm_head.forward(&self.rms(h, &self.norm));
        match self.cfg.final_logit_softcapping {
            Some(cap) => (logits / cap).tanh() * cap,
            None => logits,
        }
    }

    /// Concatenates the sequences' replay tensors, all or none.
    fn packed_replay(&self, seqs: &[SeqInput<'_>], total: usize) -> Result<Option<Tensor>> {
        let given = seqs.iter().filter(|s| s.replay.is_some()).count();
        if given == 0 {
            return Ok(None);
        }
        let Some(moe) = &self.cfg.moe else {
            return Err(Error::Input(
                "routing replay was given for a dense model".into(),
            ));
        };
        if given != seqs.len() {
            return Err(Error::Input(
                "routing replay must be given for every sequence of a batch or none".into(),
            ));
        }
        let parts: Vec<&Tensor> = seqs.iter().filter_map(|s| s.replay).collect();
        let packed = Tensor::cat(&parts, 0);
        let expected = [
            total as i64,
            self.cfg.num_sparse_layers() as i64,
            moe.num_experts_per_tok as i64,
        ];
        if packed.size() != expected {
            return Err(Error::Input(format!(
                "replayed routing has shape {:?} in all, expected {expected:?} (tokens, sparse layers, top_k)",
                packed.size()
            )));
        }
        Ok(Some(packed))
    }
}

/// A checked batch, laid out packed.
#[derive(Debug)]
struct Packed {
    ids: Tensor,
    positions: Tensor,
    token_slots: Vec<i64>,
    last_rows: Vec<i64>,
    spans: Vec<Span>,
    /// `[tokens, sparse layers, top_k]` routing to replay.
    replay: Option<Tensor>,
    /// `[3, tokens]` multimodal rotary positions, when a sequence has images.
    mrope: Option<Tensor>,
    /// The image placeholders among the tokens, to fill with the vision tower's output.
    images: Vec<multimodal::PackedImage>,
    /// Each row's LoRA adapter.
    adapters: Rows,
}

impl Packed {
    /// The routing to replay in the `sparse`-th sparse layer, `[tokens, top_k]`.
    fn layer_replay(&self, sparse: usize) -> Option<Tensor> {
        self.replay.as_ref().map(|r| r.select(1, sparse as i64))
    }
}

/// The trainer's forward of one packed batch (no cache), a stage at a time, so a caller can run
/// each decoder layer when it chooses: a trainer that shards its weights gathers each layer's
/// just before it runs, and recomputes a layer from its input for the backward
/// (docs/distributed.md). Composed, the stages are [`CausalLm::forward`] with `LogitsFor::All`:
/// `head(layer(L-1, … layer(0, embed())))`.
pub struct Stages<'m> {
    model: &'m CausalLm,
    packed: Packed,
    ropes: (RopeAt, Option<RopeAt>),
}

impl Stages<'_> {
    pub fn num_layers(&self) -> usize {
        self.model.layers.len()
    }

    pub fn vocab_size(&self) -> usize {
        self.model.cfg.vocab_size
    }

    /// The token embeddings, `[tokens, hidden]`, image placeholders replaced by the vision
    /// tower's output: a sharded trainer gathers the vision unit ([`CausalLm::vision_unit`]) with
    /// the embedding's when [`Stages::has_images`].
    pub fn embed(&self) -> Tensor {
        self.model.embed_packed(&self.packed)
    }

    /// Whether the batch's tokens include image placeholders within it (the vision tower runs
    /// in [`Stages::embed`]).
    pub fn has_images(&self) -> bool {
        !self.packed.images.is_empty()
    }

    /// Decoder layer `l` on `h`. A sparse layer routes as `routing` says (`[tokens, top_k]`,
    /// what an earlier run of the layer returned), else as the batch's replay says, else by its
    /// router; it returns the experts it used.
    pub fn layer(
        &self,
        l: usize,
        h: &Tensor,
        routing: Option<&Tensor>,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let replay = match routing {
            Some(r) => Some(r.shallow_clone()),
            None => self.packed.layer_replay(self.model.sparse_index(l)),
        };
        self.model
            .layer_step(l, h, &self.packed, &self.ropes, None, replay.as_ref())
    }

    /// The logits of the rows `h` (any rows of the last layer's output).
    pub fn head(&self, h: &Tensor) -> Tensor {
        self.model.head(h)
    }
}
