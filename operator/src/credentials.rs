//! The run's two credentials (docs/security.md): the run token, which the coordinator, trainer
//! and engines hold and which opens every internal endpoint, and the agent credential, which
//! agent pods hold and which opens only what an agent needs on the coordinator (leasing and
//! returning episodes, generating).
//!
//! The agent credential is derived from the run token (HMAC-SHA256 of a fixed label, keyed by
//! the token), so the operator keeps one random secret per run and every holder of the run token
//! can check an agent's credential, while a holder of the agent credential cannot recover the
//! run token from it.

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// What the agent credential is the MAC of; a new version of the scheme changes the label.
const AGENT_LABEL: &[u8] = b"moult agent credential v1";

/// The agent credential of the run whose token is `run_token` (64 lowercase hex digits).
pub fn agent_credential(run_token: &str) -> String {
    mac(run_token, &[AGENT_LABEL])
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// HMAC-SHA256 keyed by the run token (trimmed, as the Secret's value is read) of `parts`
/// concatenated: the agent credential, and the proofs of the weight stream's handshake.
pub fn mac(run_token: &str, parts: &[&[u8]]) -> [u8; 32] {
    let mut mac = Hmac::<Sha256>::new_from_slice(run_token.trim().as_bytes())
        .expect("HMAC takes a key of any length");
    for part in parts {
        mac.update(part);
    }
    mac.finalize().into_bytes().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_agent_credential_is_hmac_sha256_of_the_label() {
        // The construction, computed independently with Python:
        // hmac.new(b"s3cret", b"moult agent credential v1", hashlib.sha256).hexdigest()
        assert_eq!(agent_credential("s3cret"), PYTHON_S3CRET);
        assert_eq!(agent_credential(" s3cret\n"), PYTHON_S3CRET);
        assert_ne!(agent_credential("s3cret2"), PYTHON_S3CRET);
        assert_eq!(agent_credential("s3cret").len(), 64);
    }

    const PYTHON_S3CRET: &str = "d478a5f7a6768b33bb0c74befddd46ade50bac8e39aea1faf4b5e86f48677d81";
}
