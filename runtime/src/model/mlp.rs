//! The gated MLP every decoder layer, expert and vision block runs (SwiGLU, or GeGLU for Gemma),
//! and its activation as `config.json` names it.

use tch::Tensor;

use super::linear::Linear;
use super::lora::Rows;

/// The MLP's gate activation (`hidden_act` / `hidden_activation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `silu`: SwiGLU.
    Silu,
    /// `gelu_pytorch_tanh`: GeGLU with the tanh approximation (Gemma).
    GeluTanh,
    /// `gelu`: GeGLU, exact.
    Gelu,
}

impl Activation {
    /// The names this accepts, for a message refusing another.
    pub const SUPPORTED: &'static str = "silu, gelu_pytorch_tanh, gelu";

    /// The activation a `config.json` names (`None` for one not implemented).
    pub fn from_config_name(name: &str) -> Option<Self> {
        match name {
            "silu" | "swish" => Some(Self::Silu),
            "gelu_pytorch_tanh" => Some(Self::GeluTanh),
            "gelu" => Some(Self::Gelu),
            _ => None,
        }
    }
}

/// `down(act(gate(x)) ⊙ up(x))` (SwiGLU, or GeGLU for Gemma), with `gate` and `up` stacked in
/// `gate_up`; each row with the adapter `rows` gives it.
pub(super) fn gated_mlp(
    x: &Tensor,
    gate_up: &Linear,
    down: &Linear,
    act: Activation,
    rows: &Rows,
) -> Tensor {
    let gu = gate_up.forward_rows(x, rows);
    let i = gu.size()[1] / 2;
    let gate = gu.narrow(1, 0, i);
    let gate = match act {
        Activation::Silu => gate.silu(),
        Activation::GeluTanh => gate.gelu("tanh"),
        Activation::Gelu => gate.gelu("none"),
    };
    down.forward_rows(&(gate * gu.narrow(1, i, i)), rows)
}
