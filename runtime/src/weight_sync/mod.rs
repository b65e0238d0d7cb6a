//! Weight sync (docs/engine.md): moving a new policy's weights from the trainer to every engine.
//!
//! - [`nccl_handshake`]: the messages of the NCCL data plane to vLLM engines (unique id as base64,
//!   rank offsets, world size), pure and tested everywhere;
//! - [`nccl_control`]: the engines' weight-transfer endpoints that drive that data plane;
//! - `nccl` (cargo feature `cuda`): the trainer's side of that data plane on cudarc's NCCL.
//!
//! - [`orchestrate`]: one update as the trainer side runs it: pause, transfer (TCP data plane to
//!   built-in engines), finish with the version, resume; and the control calls every transport
//!   makes;
//! - [`folder`]: the Filesystem transport (safetensors in a shared folder, reloaded by engines);
//! - [`publish`]: the one publisher `moult run` and `moult trainer` use, over all three;
//! - [`stream`]: the buckets an update is made of, as a trainer gathers them.
//!
//! The TCP data plane itself lives in [`crate::engine::weights`].

pub mod folder;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod nccl_control;
pub mod nccl_handshake;
pub mod orchestrate;
pub mod publish;
pub mod stream;
