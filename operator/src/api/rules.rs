//! Rules shared by several fields of the spec: names and labels as Kubernetes spells them, and
//! the CEL rules that check them.

use kube::core::{Message, Rule};

/// A DNS-1123 subdomain (object names: PersistentVolumeClaims, PriorityClasses).
pub(crate) const DNS_SUBDOMAIN: &str =
    "^[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*$";
/// A label key: an optional DNS subdomain and `/`, then a name of letters, digits, `-_.`.
pub(crate) const LABEL_KEY: &str =
    "^([a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$";
/// A label value (possibly empty).
pub(crate) const LABEL_VALUE: &str = "^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$";

/// The rule that the `resources` of the struct it is on (`field`) hold quantities: the CRD takes
/// any string there (Kubernetes' own schema of a quantity has no pattern), a pod does not.
pub(crate) fn resources_rule(field: &str) -> Rule {
    let all = |part: &str| {
        format!("(!has(self.resources.{part}) || self.resources.{part}.all(k, isQuantity(string(self.resources.{part}[k]))))")
    };
    Rule::new(format!(
        "!has(self.resources) || ({} && {})",
        all("limits"),
        all("requests")
    ))
    .message(Message::Message(format!(
        "{field} limits and requests must be quantities, such as 500m, 4 or 16Gi"
    )))
}

/// The rule that no limit of the `resources` of the struct it is on (`field`) is below its
/// request: Kubernetes refuses such a pod, so the run would never start.
pub(crate) fn limits_rule(field: &str) -> Rule {
    let (limit, request) = (
        "quantity(string(self.resources.limits[k]))",
        "quantity(string(self.resources.requests[k]))",
    );
    Rule::new(format!(
        "!has(self.resources) || !has(self.resources.limits) || !has(self.resources.requests) || self.resources.requests.all(k, !(k in self.resources.limits) || !isQuantity(string(self.resources.limits[k])) || !isQuantity(string(self.resources.requests[k])) || !{limit}.isLessThan({request}))"
    ))
    .message(Message::Message(format!(
        "{field}: a limit is below its request; each limit must be at least the request of the same resource"
    )))
}

/// The rule that `field` (the `claimName` of the struct it is on) names a PersistentVolumeClaim.
pub(crate) fn claim_rule(field: &str) -> Rule {
    Rule::new(format!(
        "!has(self.claimName) || self.claimName.matches('{DNS_SUBDOMAIN}')"
    ))
    .message(Message::Message(format!(
        "{field} must name a PersistentVolumeClaim: lowercase letters, digits, '-' and '.', starting and ending with a letter or digit"
    )))
}
