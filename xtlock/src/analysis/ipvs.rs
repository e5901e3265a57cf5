//! IPVS analysis: connections scheduled, real-server changes with who made them, stale
//! forwarding per connection (packets still sent to a removed or weight-0 real server) from
//! its first packet to the end of the connection entry, and exact per-backend packet counts.
//! Pure: events in, facts out.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;

use serde::Serialize;

use super::facts::{DestChange, IpvsCountFact, IpvsFact};
use crate::decode::{DestState, IpvsCounts, IpvsEvent, IpvsOp, StaleAction};

/// Protocol name as ipvsadm writes it (lower case).
pub fn proto_name(p: u8) -> &'static str {
    match p {
        6 => "tcp",
        17 => "udp",
        132 => "sctp",
        _ => "ip",
    }
}

/// Per (protocol, service, backend): what the summary shows.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct IpvsBackendSummary {
    pub connections: u64,
    /// Packets forwarded (to a usable or weight-0 backend).
    pub packets: u64,
    /// Packets on connections whose backend was stale (weight 0 or removed).
    pub stale_packets: u64,
}

#[derive(Clone, Debug)]
struct StaleConn {
    protocol: u8,
    service: SocketAddr,
    backend: SocketAddr,
    client: Option<SocketAddr>,
    state: DestState,
    action: StaleAction,
    first_ns: u64,
    last_ns: u64,
    packets: u64,
}

type BackendKey = (u8, SocketAddr, SocketAddr);

/// Most stale connections followed at once; beyond it the oldest are forgotten.
const MAX_STALE: usize = 65536;

#[derive(Debug, Default)]
pub struct IpvsTracker {
    changes: HashMap<BackendKey, DestChange>,
    stale: HashMap<u64, StaleConn>,
    backends: BTreeMap<(String, String, String), IpvsBackendSummary>,
}

fn summary_key(k: &BackendKey) -> (String, String, String) {
    (
        proto_name(k.0).to_string(),
        k.1.to_string(),
        k.2.to_string(),
    )
}

impl IpvsTracker {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn on_event(&mut self, e: &IpvsEvent, out: &mut impl FnMut(IpvsFact)) {
        let key = (e.protocol, e.service, e.backend);
        let base = IpvsFact {
            ts_ns: e.ts_ns,
            event: "",
            protocol: proto_name(e.protocol),
            service: e.service.to_string(),
            backend: e.backend.to_string(),
            client: e.client.map(|c| c.to_string()),
            weight: e.weight,
            pid: None,
            comm: None,
            ret: None,
            backend_state: None,
            action: None,
            packets: None,
            first_packet_ns: None,
            last_packet_ns: None,
            entry_left_ns: None,
            expired_ns: None,
            change: None,
        };
        match e.op {
            IpvsOp::Scheduled => {
                self.backends
                    .entry(summary_key(&key))
                    .or_default()
                    .connections += 1;
                out(IpvsFact {
                    event: "scheduled",
                    ..base
                });
            }
            IpvsOp::DestAdded | IpvsOp::DestRemoved | IpvsOp::DestEdited => {
                let event = match e.op {
                    IpvsOp::DestAdded => "dest_added",
                    IpvsOp::DestRemoved => "dest_removed",
                    _ => "dest_edited",
                };
                let comm = e.comm.as_str().into_owned();
                if e.ret == 0 {
                    match e.op {
                        IpvsOp::DestRemoved => {
                            self.changes.insert(
                                key,
                                DestChange {
                                    ts_ns: e.ts_ns,
                                    what: "removed",
                                    pid: e.tgid,
                                    comm: comm.clone(),
                                },
                            );
                        }
                        IpvsOp::DestEdited if e.weight == 0 => {
                            self.changes.insert(
                                key,
                                DestChange {
                                    ts_ns: e.ts_ns,
                                    what: "weight_0",
                                    pid: e.tgid,
                                    comm: comm.clone(),
                                },
                            );
                        }
                        // Added back, or weight above 0 again: no longer stale.
                        _ => {
                            self.changes.remove(&key);
                        }
                    }
                }
                out(IpvsFact {
                    event,
                    pid: Some(e.tgid),
                    comm: Some(comm),
                    ret: Some(e.ret),
                    ..base
                });
            }
            IpvsOp::Stale => {
                let first = !self.stale.contains_key(&e.conn);
                if first && self.stale.len() >= MAX_STALE {
                    if let Some(oldest) = self
                        .stale
                        .iter()
                        .min_by_key(|(_, s)| s.last_ns)
                        .map(|(k, _)| *k)
                    {
                        self.stale.remove(&oldest);
                    }
                }
                let s = self.stale.entry(e.conn).or_insert_with(|| StaleConn {
                    protocol: e.protocol,
                    service: e.service,
                    backend: e.backend,
                    client: e.client,
                    state: e.dest_state,
                    action: e.action,
                    first_ns: e.ts_ns,
                    last_ns: e.ts_ns,
                    packets: 0,
                });
                s.packets += e.packets;
                s.last_ns = s.last_ns.max(e.last_packet_ns).max(e.ts_ns);
                s.action = e.action;
                s.state = e.dest_state;
                if first {
                    out(IpvsFact {
                        event: "stale",
                        backend_state: Some(e.dest_state.as_str()),
                        action: Some(e.action),
                        packets: Some(s.packets),
                        first_packet_ns: Some(s.first_ns),
                        last_packet_ns: Some(s.last_ns),
                        entry_left_ns: Some(e.timer_left_ns),
                        change: self.changes.get(&key).cloned(),
                        ..base
                    });
                }
            }
            IpvsOp::ServiceAdded | IpvsOp::ServiceEdited | IpvsOp::ServiceRemoved => {
                let event = match e.op {
                    IpvsOp::ServiceAdded => "service_added",
                    IpvsOp::ServiceEdited => "service_edited",
                    _ => "service_removed",
                };
                out(IpvsFact {
                    event,
                    backend: String::new(),
                    weight: 0,
                    pid: Some(e.tgid),
                    comm: Some(e.comm.as_str().into_owned()),
                    // ip_vs_unlink_service cannot fail and is seen at entry.
                    ret: (e.op != IpvsOp::ServiceRemoved).then_some(e.ret),
                    ..base
                });
            }
            IpvsOp::Expired => {
                let Some(mut s) = self.stale.remove(&e.conn) else {
                    return;
                };
                s.packets += e.packets;
                s.last_ns = s.last_ns.max(e.last_packet_ns);
                out(self.end_fact(s, Some(e.ts_ns)));
            }
        }
    }

    fn end_fact(&self, s: StaleConn, expired_ns: Option<u64>) -> IpvsFact {
        let key = (s.protocol, s.service, s.backend);
        let change = self.changes.get(&key).cloned();
        IpvsFact {
            ts_ns: change
                .as_ref()
                .map_or(s.first_ns, |c| c.ts_ns.min(s.first_ns)),
            event: "stale_end",
            protocol: proto_name(s.protocol),
            service: s.service.to_string(),
            backend: s.backend.to_string(),
            client: s.client.map(|c| c.to_string()),
            weight: 0,
            pid: None,
            comm: None,
            ret: None,
            backend_state: Some(s.state.as_str()),
            action: Some(s.action),
            packets: Some(s.packets),
            first_packet_ns: Some(s.first_ns),
            last_packet_ns: Some(s.last_ns),
            entry_left_ns: None,
            expired_ns,
            change,
        }
    }

    pub fn on_counts(&mut self, c: &IpvsCounts, out: &mut impl FnMut(IpvsCountFact)) {
        for d in &c.counts {
            let b = self
                .backends
                .entry(summary_key(&(d.protocol, d.service, d.backend)))
                .or_default();
            match d.state {
                DestState::Ok => b.packets += d.count,
                DestState::Quiescent => {
                    b.packets += d.count;
                    b.stale_packets += d.count;
                }
                DestState::Removed => b.stale_packets += d.count,
            }
            out(IpvsCountFact {
                ts_ns: c.ts_ns,
                interval_ns: c.interval_ns,
                protocol: proto_name(d.protocol),
                service: d.service.to_string(),
                backend: d.backend.to_string(),
                backend_state: d.state.as_str(),
                packets: d.count,
            });
        }
        if c.overflow > 0 {
            tracing::warn!(
                packets = c.overflow,
                "IPVS packets not counted per backend: the kernel's key map is full"
            );
        }
    }

    /// End of tracing: the stale connections still open, as `stale_end` facts without an
    /// expiry.
    pub fn finish(&mut self, out: &mut impl FnMut(IpvsFact)) {
        let mut open: Vec<StaleConn> = self.stale.drain().map(|(_, s)| s).collect();
        open.sort_by_key(|s| s.first_ns);
        for s in open {
            out(self.end_fact(s, None));
        }
    }

    /// Per (protocol, service, backend): connections, packets, stale packets.
    pub fn summary(&self) -> Vec<(String, String, String, IpvsBackendSummary)> {
        self.backends
            .iter()
            .map(|((p, s, b), v)| (p.clone(), s.clone(), b.clone(), v.clone()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::{Comm, IpvsCount};

    fn ev(ts: u64, op: IpvsOp, conn: u64, backend: &str) -> IpvsEvent {
        IpvsEvent {
            ts_ns: ts,
            tgid: 42,
            tid: 42,
            comm: Comm::new("ipvsadm"),
            op,
            conn,
            protocol: 17,
            service: "10.96.0.10:53".parse().unwrap(),
            client: (conn != 0).then(|| "10.0.0.9:40000".parse().unwrap()),
            backend: backend.parse().unwrap(),
            dest_state: DestState::Removed,
            action: StaleAction::Dropped,
            weight: 1,
            ret: 0,
            packets: 1,
            last_packet_ns: ts,
            timer_left_ns: 5_000_000_000,
        }
    }

    #[test]
    fn removed_backend_then_stale_packets_then_expiry() {
        let mut t = IpvsTracker::new();
        let mut facts = Vec::new();
        let mut out = |f: IpvsFact| facts.push(f);
        t.on_event(&ev(10, IpvsOp::Scheduled, 7, "10.0.1.5:53"), &mut out);
        t.on_event(&ev(20, IpvsOp::DestRemoved, 0, "10.0.1.5:53"), &mut out);
        let mut s = ev(30, IpvsOp::Stale, 7, "10.0.1.5:53");
        t.on_event(&s, &mut out);
        s.ts_ns = 40;
        s.packets = 36;
        t.on_event(&s, &mut out);
        let mut x = ev(90, IpvsOp::Expired, 7, "10.0.1.5:53");
        x.packets = 0;
        x.last_packet_ns = 45;
        t.on_event(&x, &mut out);
        let events: Vec<&str> = facts.iter().map(|f| f.event).collect();
        assert_eq!(events, ["scheduled", "dest_removed", "stale", "stale_end"]);
        let stale = &facts[2];
        assert_eq!(stale.change.as_ref().unwrap().ts_ns, 20);
        assert_eq!(stale.client.as_deref(), Some("10.0.0.9:40000"));
        let end = &facts[3];
        assert_eq!(end.ts_ns, 20);
        assert_eq!(end.packets, Some(37));
        assert_eq!(end.last_packet_ns, Some(45));
        assert_eq!(end.expired_ns, Some(90));
        assert_eq!(end.backend, "10.0.1.5:53");
        let v = serde_json::to_value(end).unwrap();
        assert_eq!(v["action"], "dropped");
        assert_eq!(v["change"]["comm"], "ipvsadm");
    }

    #[test]
    fn counts_feed_the_summary() {
        let mut t = IpvsTracker::new();
        let mut n = 0;
        let c = IpvsCounts {
            ts_ns: 5,
            interval_ns: 1,
            counts: vec![
                IpvsCount {
                    protocol: 17,
                    service: "10.96.0.10:53".parse().unwrap(),
                    backend: "10.0.1.5:53".parse().unwrap(),
                    state: DestState::Ok,
                    count: 10,
                },
                IpvsCount {
                    protocol: 17,
                    service: "10.96.0.10:53".parse().unwrap(),
                    backend: "10.0.1.5:53".parse().unwrap(),
                    state: DestState::Removed,
                    count: 3,
                },
            ],
            overflow: 0,
        };
        t.on_counts(&c, &mut |_| n += 1);
        assert_eq!(n, 2);
        let s = t.summary();
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].3.packets, 10);
        assert_eq!(s[0].3.stale_packets, 3);
    }
}
