//! IPVS's virtual and real servers in the namespace xtlock runs in (the node's), read over
//! generic netlink as `ipvsadm -Ln` reads them, every [`PERIOD`] while the `ip_vs` module is
//! loaded, and handed over as [`IpvsTable`] events when they changed: where kube-proxy's ipvs
//! mode routes each Service, with weights, for the dead-endpoint windows. A read takes one
//! dump of the services and one per service; on a big table the reads space out to keep them
//! under 2 % of a CPU. Nothing is read, and no module is loaded, on a node without IPVS.

use std::path::Path;
use std::time::{Duration, Instant};

use super::netlink::{NlError, NlSocket};
use super::worker::{Out, Worker as Thread};
use crate::decode::ipvs_nl::{self, IpvsMsg};
use crate::event::{Event, IpvsService, IpvsTable};

/// How often the table is read.
pub const PERIOD: Duration = Duration::from_secs(1);
/// A read takes at most 1 / BUDGET of the time between reads.
const BUDGET: u32 = 50;
/// Services read at most (kube-proxy's 10,000-service node has ~10,000 per port).
pub const MAX_SERVICES: usize = 65_536;
/// How long one answer may be waited for.
const RECV_TIMEOUT: Duration = Duration::from_secs(2);

/// The live handle: tables out; dropping it stops and joins the worker.
pub struct IpvsReader {
    thread: Thread<Event>,
}

impl IpvsReader {
    /// Opens a generic netlink socket here (so a failure is said at once), then reads in a
    /// thread of its own.
    pub fn start(netns: u32) -> std::io::Result<Self> {
        use netlink_sys::protocols::NETLINK_GENERIC;
        let sock = NlSocket::open(NETLINK_GENERIC, RECV_TIMEOUT)?;
        let thread = Thread::spawn("xtlock-ipvs", 64, move |events: Out<Event>| {
            Worker {
                sock: sock.stop_with(events.stop.clone()),
                netns,
                events,
                family: None,
                last: None,
                warned: false,
            }
            .run()
        })?;
        Ok(IpvsReader { thread })
    }

    /// The changed tables read since the last call.
    pub fn poll(&mut self, out: &mut Vec<Event>) {
        self.thread.poll(out);
    }
}

struct Worker {
    sock: NlSocket,
    netns: u32,
    events: Out<Event>,
    family: Option<u16>,
    /// The last table handed over.
    last: Option<Vec<IpvsService>>,
    /// The last read failed, and said so.
    warned: bool,
}

impl Worker {
    fn run(&mut self) {
        loop {
            let start = Instant::now();
            // Asking for the family without the module would load it.
            if Path::new("/sys/module/ip_vs").exists() {
                match self.read() {
                    Ok(services) => {
                        self.hand_over(services);
                        self.warned = false;
                    }
                    // Said once until a read works again (the module may be unloading); the
                    // family is asked for anew.
                    Err(e) => {
                        if !self.warned {
                            tracing::warn!(error = %e, "cannot read the IPVS table: IPVS real servers are not checked for dead endpoints until it can");
                        }
                        self.warned = true;
                        self.family = None;
                    }
                }
            } else if self.last.as_ref().is_some_and(|l| !l.is_empty()) {
                // Unloaded: no virtual server is left.
                self.hand_over(Vec::new());
            }
            if !self.events.stop.sleep(PERIOD.max(start.elapsed() * BUDGET)) {
                return;
            }
        }
    }

    fn hand_over(&mut self, services: Vec<IpvsService>) {
        if self.last.as_ref() == Some(&services) {
            return;
        }
        self.last = Some(services.clone());
        let ev = Event::IpvsTable(Box::new(IpvsTable {
            ts_ns: super::monotonic_ns(),
            netns: self.netns,
            services,
        }));
        // A full queue (nobody reading) only delays the change to the next read that differs.
        if self.events.try_send(ev).is_err() {
            self.last = None;
        }
    }

    /// Every service with its real servers, sorted.
    fn read(&mut self) -> Result<Vec<IpvsService>, String> {
        let family = match self.family {
            Some(f) => f,
            None => {
                let f = self.family()?;
                self.family = Some(f);
                f
            }
        };
        let mut services = Vec::new();
        let req = ipvs_nl::services_request(family, self.sock.next_seq());
        self.dump(&req, None, |m| {
            if let IpvsMsg::Service(s) = m {
                if services.len() < MAX_SERVICES {
                    services.push(s);
                }
            }
        })?;
        for svc in services.iter_mut() {
            let req = ipvs_nl::dests_request(family, self.sock.next_seq(), svc);
            let af = ipvs_nl::service_af(svc);
            let mut dests = Vec::new();
            self.dump(&req, Some(af), |m| {
                if let IpvsMsg::Dest(d) = m {
                    dests.push(d);
                }
            })?;
            dests.sort();
            svc.dests = dests;
        }
        services.sort();
        Ok(services)
    }

    fn family(&mut self) -> Result<u16, String> {
        let mut id = None;
        let req = ipvs_nl::family_request(self.sock.next_seq());
        self.dump(&req, None, |m| {
            if let IpvsMsg::Family(f) = m {
                id = Some(f);
            }
        })?;
        id.ok_or_else(|| "the kernel has no IPVS netlink family".to_string())
    }

    /// Sends `request` and hands each message of the answer to `each`, to its end (a
    /// dump's `DONE`, or the single answer of a plain request).
    fn dump(
        &mut self,
        request: &[u8],
        svc_af: Option<u16>,
        mut each: impl FnMut(IpvsMsg),
    ) -> Result<(), String> {
        self.sock
            .exchange(request, |m| {
                each(ipvs_nl::answer(&m, svc_af));
                Ok::<(), std::convert::Infallible>(())
            })
            .map_err(|e: NlError<_>| format!("asking IPVS: {e}"))
    }
}
