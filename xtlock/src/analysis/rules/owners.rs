//! Whose a chain is when xtlock did not see it created: the naming conventions of the agents
//! people run (docs/rules.md lists them). A chain created while xtlock watched belongs to its
//! creator instead.

/// The agent that by convention owns `chain`, as xtlock names agents (their process names).
pub fn conventional_owner(chain: &str) -> Option<&'static str> {
    let prefixed = |p: &str| chain.starts_with(p);
    Some(match chain {
        _ if prefixed("KUBE-KUBELET-") => "kubelet",
        _ if prefixed("KUBE-ROUTER-") => "kube-router",
        _ if prefixed("KUBE-") => "kube-proxy",
        _ if prefixed("cali-") => "calico-node",
        _ if prefixed("CILIUM_") || prefixed("OLD_CILIUM_") => "cilium-agent",
        _ if prefixed("DOCKER") => "dockerd",
        _ if prefixed("CNI-HOSTPORT-") || prefixed("CNI-DN-") => "portmap",
        _ if prefixed("CNI-") => "bridge",
        _ if prefixed("WEAVE") => "weave-npc",
        _ if prefixed("FLANNEL") => "flanneld",
        _ if is_firewalld(chain) => "firewalld",
        _ => return None,
    })
}

/// firewalld's chains (iptables backend): `INPUT_direct`, `INPUT_ZONES`, `IN_public`,
/// `IN_public_allow`, `FWD_*`, `FWDI_*`, `FWDO_*`, `OUT_*`, `PRE_*`, `POST_*`.
fn is_firewalld(chain: &str) -> bool {
    chain.ends_with("_direct")
        || chain.ends_with("_ZONES")
        || chain.contains("_ZONES_")
        || chain.ends_with("_POLICIES")
        || ["IN_", "FWD_", "FWDI_", "FWDO_", "OUT_", "PRE_", "POST_"]
            .iter()
            .any(|p| chain.starts_with(p))
}

#[cfg(test)]
mod tests {
    use super::conventional_owner as o;

    #[test]
    fn conventions() {
        assert_eq!(o("KUBE-SERVICES"), Some("kube-proxy"));
        assert_eq!(o("KUBE-KUBELET-CANARY"), Some("kubelet"));
        assert_eq!(o("cali-INPUT"), Some("calico-node"));
        assert_eq!(o("DOCKER-USER"), Some("dockerd"));
        assert_eq!(o("CNI-HOSTPORT-DNAT"), Some("portmap"));
        assert_eq!(o("IN_public_allow"), Some("firewalld"));
        assert_eq!(o("INPUT_direct"), Some("firewalld"));
        assert_eq!(o("INPUT"), None);
        assert_eq!(o("MY-CHAIN"), None);
    }
}
