//! IPVS's virtual and real servers in the namespace xtlock runs in (the node's), read over
//! generic netlink as `ipvsadm -Ln` reads them, every [`PERIOD`] while the `ip_vs` module is
//! loaded, and handed over as [`IpvsTable`] events when they changed: where kube-proxy's ipvs
//! mode routes each Service, with weights, for the dead-endpoint windows. A read takes one
//! dump of the services and one per service; on a big table the reads space out to keep them
//! under 2 % of a CPU. Nothing is read, and no module is loaded, on a node without IPVS.

use std::path::Path;
use std::sync::mpsc;
use std::time::{Duration, Instant};

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

/// The live handle: tables out.
pub struct IpvsReader {
    rx: mpsc::Receiver<Event>,
}

impl IpvsReader {
    /// Opens a generic netlink socket here (so a failure is said at once), then reads in a
    /// thread of its own.
    pub fn start(netns: u32) -> std::io::Result<Self> {
        use netlink_sys::{protocols::NETLINK_GENERIC, Socket, SocketAddr};
        let mut sock = Socket::new(NETLINK_GENERIC)?;
        sock.bind_auto()?;
        sock.connect(&SocketAddr::new(0, 0))?;
        super::addrs::set_recv_timeout(&sock, RECV_TIMEOUT)?;
        let (events, rx) = mpsc::sync_channel(64);
        let mut w = Worker {
            sock,
            netns,
            events,
            family: None,
            seq: 0,
            last: None,
            warned: false,
            buf: Vec::with_capacity(1 << 16),
        };
        std::thread::Builder::new()
            .name("xtlock-ipvs".into())
            .spawn(move || w.run())?;
        Ok(IpvsReader { rx })
    }

    /// The changed tables read since the last call.
    pub fn poll(&mut self, out: &mut Vec<Event>) {
        out.extend(self.rx.try_iter());
    }
}

struct Worker {
    sock: netlink_sys::Socket,
    netns: u32,
    events: mpsc::SyncSender<Event>,
    family: Option<u16>,
    seq: u32,
    /// The last table handed over.
    last: Option<Vec<IpvsService>>,
    /// The last read failed, and said so.
    warned: bool,
    buf: Vec<u8>,
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
                        self.drain();
                    }
                }
            } else if self.last.as_ref().is_some_and(|l| !l.is_empty()) {
                // Unloaded: no virtual server is left.
                self.hand_over(Vec::new());
            }
            std::thread::sleep(PERIOD.max(start.elapsed() * BUDGET));
        }
    }

    /// Whatever is left of an answer that failed halfway, so the next one starts clean.
    fn drain(&mut self) {
        loop {
            self.buf.clear();
            if self.sock.recv(&mut self.buf, libc::MSG_DONTWAIT).is_err() || self.buf.is_empty() {
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
        self.seq = self.seq.wrapping_add(1);
        let mut services = Vec::new();
        self.dump(&ipvs_nl::services_request(family, self.seq), None, |m| {
            if let IpvsMsg::Service(s) = m {
                if services.len() < MAX_SERVICES {
                    services.push(s);
                }
            }
        })?;
        for svc in services.iter_mut() {
            self.seq = self.seq.wrapping_add(1);
            let req = ipvs_nl::dests_request(family, self.seq, svc);
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
        self.seq = self.seq.wrapping_add(1);
        let mut id = None;
        self.dump(&ipvs_nl::family_request(self.seq), None, |m| {
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
        let single = !ipvs_nl::is_dump(request);
        self.sock
            .send(request, 0)
            .map_err(|e| format!("cannot ask IPVS: {e}"))?;
        loop {
            self.buf.clear();
            self.sock.recv(&mut self.buf, 0).map_err(|e| {
                format!(
                    "cannot read IPVS's answer: {e}{}",
                    super::needs(&e, "CAP_NET_ADMIN")
                )
            })?;
            for m in ipvs_nl::messages(&self.buf, svc_af)? {
                match m {
                    IpvsMsg::Done => return Ok(()),
                    IpvsMsg::Error(errno) => {
                        return Err(format!(
                            "the kernel refused: {}",
                            std::io::Error::from_raw_os_error(errno)
                        ))
                    }
                    m => {
                        each(m);
                        if single {
                            return Ok(());
                        }
                    }
                }
            }
        }
    }
}
