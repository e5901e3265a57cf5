//! `xtlock report CAPTURE --html FILE`, in a real browser: an incident recorded live
//! (kube-proxy's rules; calico-node's `iptables-legacy -w` waiting behind kube-proxy's hold; a
//! DROP firewalld put in kube-proxy's chain; a UDP flood that rule drops), its page written by
//! `report --html`, then opened by Debian's chromium, headless. The page must render without a script error, and its marks must match
//! the capture's facts in number, type by type (`report --json --events` is the truth). A
//! screenshot is kept as the test's artifact (`target/test-artifacts/report-html.png`).

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Command,
    thread,
    time::Duration,
};

use xtlock_tests::{
    agent_step, in_ci, report_events, require_bpf, send_udp, serial, xtlock_bin, Agent, NetnsPair,
    Scratch,
};

const T: Duration = Duration::from_secs(20);

/// The fact types the page draws (`sinks/html.rs`: every one a line says, but samples and
/// processes).
const DRAWN: &[&str] = &[
    "hold",
    "wait",
    "timeout",
    "lost",
    "drop_count",
    "conntrack",
    "hold_drops",
    "ipvs",
    "conntrack_refused",
    "stall",
    "rule_change",
    "mixed_backends",
    "unserialized",
    "refusal_count",
    "hold_refusals",
    "stale_endpoint_open",
    "stale_endpoint",
    "endpoint_programmed",
    "ipvs_drained",
    "rule_drops",
    "uncounted_drops",
];

fn chromium() -> Option<PathBuf> {
    ["/usr/bin/chromium", "/usr/bin/chromium-browser"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
}

/// Chromium, headless, on `page` with `args` (a profile of its own, no sandbox: root).
fn browse(browser: &Path, profile: &Path, page: &Path, args: &[&str]) -> std::process::Output {
    Command::new(browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-extensions",
            "--virtual-time-budget=10000",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .arg(format!("file://{}", page.display()))
        .output()
        .expect("run chromium")
}

#[test]
fn the_html_report_renders_every_fact_in_a_real_browser() {
    if !require_bpf("the_html_report_renders_every_fact_in_a_real_browser") {
        return;
    }
    let Some(browser) = chromium() else {
        assert!(
            !in_ci(),
            "chromium is missing: `./xtask/run setup` installs it (apt install chromium)"
        );
        eprintln!("skipped: no chromium (apt install chromium)");
        return;
    };
    let _g = serial();
    let name = "xtlock-html";
    let subnet = 216;
    let s = Scratch::new(name);
    let lock = s.lock_file("xtables.lock");
    let ns = NetnsPair::new(name, subnet);
    let capture = s.dir.join("incident.xtlock");
    let tracer = xtlock_tests::trace_recording(&lock, &capture, &[]);
    let step = |agent: &str, script: &str| agent_step(&s, agent, &ns.a, &lock, script, T);
    step("setup", "iptables-legacy -w -A OUTPUT -o lo -j ACCEPT");
    let rules = xtlock_tests::write_file(
        &s.dir,
        "kube-proxy.rules",
        "*filter\n:KUBE-FIREWALL - [0:0]\n-A INPUT -j KUBE-FIREWALL\n\
         -A KUBE-FIREWALL -m comment --comment \"kubernetes firewall for dropping marked packets\" \
         -m mark --mark 0x8000/0x8000 -j DROP\nCOMMIT\n",
    );
    step(
        "kube-proxy",
        &format!("iptables-legacy-restore -w --noflush < {}", rules.display()),
    );
    // kube-proxy holds the lock; calico-node's write waits behind it.
    let mut holder = Agent::spawn(
        &s.agent("kube-proxy"),
        &["hold", lock.to_str().unwrap(), "800"],
        &[],
        None,
    );
    thread::sleep(Duration::from_millis(200));
    step(
        "calico-node",
        "iptables-legacy -w -A INPUT -p tcp --dport 9 -j ACCEPT",
    );
    assert_eq!(holder.wait_within(T), 0);
    step(
        "firewalld",
        "iptables-legacy -w -I KUBE-FIREWALL -p udp --dport 9216 -j DROP",
    );
    let sent = send_udp(&s, &ns.b, &ns.addr_a, 9216, 300, 2);
    assert!(sent > 0);
    thread::sleep(Duration::from_millis(2500));
    tracer.interrupt();
    let trace = tracer.finish();
    let dump = trace.dump();

    // The truth: the capture's facts, type by type.
    let facts = report_events(&capture);
    let mut want: BTreeMap<String, usize> = BTreeMap::new();
    for f in &facts {
        let t = f["type"].as_str().unwrap_or_default();
        if DRAWN.contains(&t) {
            *want.entry(t.to_string()).or_default() += 1;
        }
    }
    for t in ["hold", "wait", "rule_change", "rule_drops", "drop_count"] {
        assert!(want.contains_key(t), "the incident has no {t}:\n{dump}");
    }
    let page = s.dir.join("incident.html");
    let out = Command::new(xtlock_bin())
        .arg("report")
        .arg(&capture)
        .arg("--html")
        .arg(&page)
        .output()
        .expect("xtlock report --html");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let html = std::fs::read_to_string(&page).expect("the page");
    assert!(!html.contains("http://") || html.contains("http://www.w3.org/2000/svg"));

    // The page in a real browser: its DOM once its script ran.
    let profile = s.dir.join("chromium");
    let dom = browse(&browser, &profile, &page, &["--dump-dom"]);
    let dom_text = String::from_utf8_lossy(&dom.stdout).into_owned();
    assert!(
        dom_text.contains("data-ready=\"1\""),
        "the page's script did not finish:\n{}\n{}",
        String::from_utf8_lossy(&dom.stderr),
        &dom_text[..dom_text.len().min(4000)]
    );
    assert!(
        dom_text.contains("<div id=\"errors\"></div>"),
        "script errors on the page:\n{dom_text}"
    );
    for (t, n) in &want {
        let drawn = dom_text.matches(&format!("data-type=\"{t}\"")).count();
        assert_eq!(drawn, *n, "{t}: {drawn} marks for {n} facts");
    }
    // A type with no fact has no mark.
    for t in DRAWN.iter().filter(|t| !want.contains_key(**t)) {
        assert!(!dom_text.contains(&format!("data-type=\"{t}\"")), "{t}");
    }

    // And a picture of it, kept.
    let artifacts = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("target")
        .join("test-artifacts");
    std::fs::create_dir_all(&artifacts).expect("artifacts dir");
    let png = artifacts.join("report-html.png");
    let _ = std::fs::remove_file(&png);
    let shot = browse(
        &browser,
        &profile,
        &page,
        &[
            &format!("--screenshot={}", png.display()),
            "--window-size=1600,1000",
            "--hide-scrollbars",
        ],
    );
    let size = std::fs::metadata(&png).map(|m| m.len()).unwrap_or(0);
    assert!(
        size > 10_000,
        "no screenshot ({size} bytes): {}",
        String::from_utf8_lossy(&shot.stderr)
    );
    eprintln!("screenshot: {} ({size} bytes)", png.display());
}
