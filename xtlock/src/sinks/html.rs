//! `xtlock report CAPTURE --html FILE`: the incident as one self-contained page, a timeline
//! per lock and agent (holds, waits and whom they waited behind), rule writes and what they
//! changed, packets dropped and connections refused, Services routed to gone endpoints. Hover
//! a mark for its line, click it for the whole fact. No network: the page carries its data,
//! style and script, so it opens on an air-gapped laptop.
//!
//! Every fact is a mark (`data-type` is its JSON type) but the samples of drops and refusals
//! (their counts are marks), execs and exits (each is a hold's or a wait's process), failed
//! tries (their waits are), IPVS counts and rule writes (the summary has them); past
//! [`MAX_MARKS`] the rest are counted and said on the page. Strings from the
//! capture reach the page as JSON data only and are put in the page as text by the script,
//! never as markup: a hostile capture cannot inject anything.

use std::io::{self, Write};

use serde::Serialize;
use serde_json::Value;

use super::terminal::{fact_text, wall_clock_label};
use super::{human_ns, Sink};
use crate::analysis::{Output, Summary};

/// Marks a page holds; past it, facts are counted, not drawn (a browser still draws 20,000
/// SVG marks smoothly).
pub const MAX_MARKS: usize = 20_000;

/// One mark of the timeline.
#[derive(Serialize)]
struct Mark {
    /// The row it is drawn on: `lock /run/xtables.lock`, `rules`, `packets`, `Service
    /// default/web:http`, ...
    lane: String,
    /// Its fact's JSON type.
    kind: String,
    /// Where its lane goes, top to bottom: locks, rule writes, dropping rules, packets,
    /// refusals, conntrack, Services, IPVS, syncs, xtlock itself.
    rank: u8,
    /// Start and end, ns after the first fact's time (a point when equal).
    start: u64,
    end: u64,
    /// Its line, as `trace` says it.
    text: String,
    fact: Value,
}

pub struct HtmlSink<W: Write> {
    out: Option<W>,
    title: String,
    /// To name times as the report's lines do.
    boot_to_wall_offset_ns: i64,
    utc_offset_s: i32,
    marks: Vec<(u64, u64, Mark)>,
    not_drawn: u64,
}

impl<W: Write> HtmlSink<W> {
    pub fn new(out: W, title: String, boot_to_wall_offset_ns: i64, utc_offset_s: i32) -> Self {
        Self {
            out: Some(out),
            title,
            boot_to_wall_offset_ns,
            utc_offset_s,
            marks: Vec::new(),
            not_drawn: 0,
        }
    }

    /// The lane and time span of a fact drawn on the page; `None` for facts not drawn.
    fn place(o: &Output) -> Option<(String, u64, u64)> {
        // The agent first: a long lock path is what a cut label loses.
        let lock_lane = |lock: &str, agent: &str| format!("{agent} · {lock}");
        Some(match o {
            Output::Hold(h) => (
                lock_lane(&h.lock, &h.who.agent),
                h.start_ns,
                h.start_ns + h.hold_ns,
            ),
            Output::Wait(w) => (
                lock_lane(&w.lock, &w.who.agent),
                w.start_ns,
                w.start_ns + w.wait_ns,
            ),
            Output::Timeout(t) => (lock_lane(&t.lock, &t.who.agent), t.ts_ns, t.ts_ns),
            Output::Stall(s) => (format!("syncs · {}", s.agent), s.ts_ns, s.ts_ns),
            Output::RuleChange(c) => (format!("rules · {}", c.agent), c.ts_ns, c.ts_ns),
            Output::MixedBackends(m) => (format!("rules · {}", m.agent), m.ts_ns, m.ts_ns),
            Output::Unserialized(u) => (format!("rules · {}", u.writer.agent), u.ts_ns, u.ts_ns),
            Output::DropCount(d) => (
                "packets dropped".into(),
                d.ts_ns.saturating_sub(d.interval_ns),
                d.ts_ns,
            ),
            Output::HoldDrops(h) => ("packets dropped".into(), h.start_ns, h.start_ns + h.hold_ns),
            Output::ConntrackRefused(c) => ("packets dropped".into(), c.ts_ns, c.ts_ns),
            Output::Conntrack(c) => (
                "conntrack".into(),
                c.ts_ns.saturating_sub(c.interval_ns),
                c.ts_ns,
            ),
            Output::RuleDrops(r) => (
                format!("dropping rules · {}", r.owner.as_deref().unwrap_or("?")),
                r.since_ns,
                r.ts_ns,
            ),
            Output::UncountedDrops(u) => ("dropping rules · ?".into(), u.ts_ns, u.ts_ns),
            Output::RefusalCount(r) => (
                "connections refused".into(),
                r.ts_ns.saturating_sub(r.interval_ns),
                r.ts_ns,
            ),
            Output::HoldRefusals(h) => (
                "connections refused".into(),
                h.start_ns,
                h.start_ns + h.hold_ns,
            ),
            Output::StaleEndpointOpen(f) => (format!("Service {}", f.service), f.ts_ns, f.ts_ns),
            Output::StaleEndpoint(f) => (
                format!("Service {}", f.service),
                f.ts_ns,
                f.ts_ns + f.stale_ns,
            ),
            Output::EndpointProgrammed(f) => (
                format!("Service {}", f.service),
                f.ts_ns,
                f.ts_ns + f.latency_ns,
            ),
            Output::IpvsDrained(f) => (
                format!("IPVS {}", f.service),
                f.ts_ns,
                f.ts_ns + f.drained_ns,
            ),
            Output::Ipvs(i) => (format!("IPVS {}", i.service), i.ts_ns, i.ts_ns),
            Output::Lost(l) => ("xtlock".into(), l.ts_ns, l.ts_ns),
            // Samples (their counts are drawn), processes (their holds and waits are), and
            // what no line says.
            Output::Drop(_)
            | Output::Refusal(_)
            | Output::Exec(_)
            | Output::Exit(_)
            | Output::FailedTry(_)
            | Output::IpvsCount(_)
            | Output::RuleWrite(_) => return None,
        })
    }

    fn write_page(&mut self, summary: &str) -> io::Result<()> {
        let Some(mut out) = self.out.take() else {
            return Ok(());
        };
        let t0 = self.marks.iter().map(|(s, _, _)| *s).min().unwrap_or(0);
        let marks: Vec<&Mark> = self
            .marks
            .iter_mut()
            .map(|(s, e, m)| {
                m.start = *s - t0;
                m.end = (*e).max(*s) - t0;
                &*m
            })
            .collect();
        let data = serde_json::json!({
            "title": self.title,
            "start": wall_clock_label(t0, self.boot_to_wall_offset_ns, self.utc_offset_s),
            "span": human_ns(marks.iter().map(|m| m.end).max().unwrap_or(0)),
            "not_drawn": self.not_drawn,
            "summary": summary,
            "marks": marks,
        });
        // Inside <script>: `<` never appears raw, so no string can close the element.
        let json = serde_json::to_string(&data)
            .map_err(io::Error::other)?
            .replace('<', "\\u003c")
            .replace('>', "\\u003e")
            .replace('&', "\\u0026");
        out.write_all(PAGE_HEAD.as_bytes())?;
        out.write_all(json.as_bytes())?;
        out.write_all(PAGE_TAIL.as_bytes())?;
        out.flush()
    }
}

impl<W: Write> Sink for HtmlSink<W> {
    fn output(&mut self, o: &Output) -> io::Result<()> {
        let Some((lane, start, end)) = Self::place(o) else {
            return Ok(());
        };
        if self.marks.len() >= MAX_MARKS {
            self.not_drawn += 1;
            return Ok(());
        }
        let fact = serde_json::to_value(o).unwrap_or(Value::Null);
        let kind = fact["type"].as_str().unwrap_or("other").to_string();
        // A rule change the terminal has no line for (nothing it says changed) is still a
        // write's read: drawn, named by its type.
        let text = fact_text(o).unwrap_or_else(|| format!("{kind} ({lane})"));
        const RANKS: &[&str] = &[
            "rules · ",
            "dropping rules",
            "packets dropped",
            "connections refused",
            "conntrack",
            "Service ",
            "IPVS ",
            "syncs · ",
            "xtlock",
        ];
        let rank = RANKS
            .iter()
            .position(|p| lane.starts_with(p))
            .map_or(0, |i| i as u8 + 1);
        self.marks.push((
            start,
            end,
            Mark {
                rank,
                lane,
                kind,
                start: 0,
                end: 0,
                text: text.trim_start_matches("!! ").to_string(),
                fact,
            },
        ));
        Ok(())
    }

    fn summary(&mut self, s: &Summary, final_: bool) -> io::Result<()> {
        self.summary_with(s, final_, None)
    }

    fn summary_filtered(
        &mut self,
        s: &Summary,
        final_: bool,
        note: &super::FilterNote,
    ) -> io::Result<()> {
        self.summary_with(s, final_, Some(note))
    }
}

impl<W: Write> HtmlSink<W> {
    /// The page, once, with the final summary as the terminal words it.
    fn summary_with(
        &mut self,
        s: &Summary,
        final_: bool,
        note: Option<&super::FilterNote>,
    ) -> io::Result<()> {
        if !final_ {
            return Ok(());
        }
        let mut text = super::TerminalSink::new(Vec::new());
        match note {
            Some(n) => text.summary_filtered(s, true, n)?,
            None => text.summary(s, true)?,
        }
        let summary = String::from_utf8_lossy(&text.into_inner()).into_owned();
        self.write_page(&summary)
    }
}

const PAGE_HEAD: &str = r#"<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:">
<title>xtlock report</title>
<style>
body { font: 13px/1.4 system-ui, sans-serif; margin: 0; color: #1d2430; background: #fafbfc; }
header { padding: 12px 16px; background: #1d2430; color: #fff; }
header h1 { font-size: 16px; margin: 0 0 4px; }
header p { margin: 0; opacity: .8; }
#tools { padding: 8px 16px; display: flex; gap: 8px; align-items: center; flex-wrap: wrap; }
#tools button { font: inherit; padding: 2px 10px; }
.key { display: inline-flex; align-items: center; gap: 4px; margin-right: 8px; }
.key i { width: 12px; height: 12px; display: inline-block; border-radius: 2px; }
#chart { overflow-x: auto; border-top: 1px solid #dde2e8; border-bottom: 1px solid #dde2e8; background: #fff; }
#chart svg text { font: 12px system-ui, sans-serif; }
.lanebg:nth-child(odd) { fill: #f4f6f8; }
.mark { cursor: pointer; }
.mark:hover { stroke: #000; stroke-width: 1px; }
#tip { position: fixed; pointer-events: none; background: #1d2430; color: #fff; padding: 6px 8px; border-radius: 4px; max-width: 640px; display: none; white-space: pre-wrap; z-index: 2; }
main { display: grid; grid-template-columns: 1fr 1fr; gap: 16px; padding: 16px; }
pre { background: #fff; border: 1px solid #dde2e8; padding: 8px; overflow: auto; max-height: 480px; margin: 0; }
h2 { font-size: 14px; margin: 0 0 6px; }
#errors:empty { display: none; }
#errors { color: #b00020; padding: 8px 16px; }
</style></head>
<body>
<header><h1 id="title"></h1><p id="sub"></p></header>
<div id="errors"></div>
<div id="tools"><button id="zin" title="zoom in">+</button><button id="zout" title="zoom out">&minus;</button><span id="keys"></span><span id="note"></span></div>
<div id="chart"></div>
<div id="tip"></div>
<main><section><h2>Selected fact</h2><pre id="detail">Click a mark.</pre></section>
<section><h2>Summary</h2><pre id="summary"></pre></section></main>
<script id="data" type="application/json">"#;

const PAGE_TAIL: &str = r##"</script>
<script>
"use strict";
window.onerror = function (m) { document.getElementById("errors").textContent += "error: " + m + "\n"; };
(function () {
  const d = JSON.parse(document.getElementById("data").textContent);
  const $ = (id) => document.getElementById(id);
  $("title").textContent = "xtlock: " + d.title;
  $("sub").textContent = "from " + d.start + ", " + d.span + " shown, " + d.marks.length + " marks";
  $("summary").textContent = d.summary;
  if (d.not_drawn > 0) { $("note").textContent = d.not_drawn + " more facts not drawn (bound reached): see the summary"; }
  const colors = {
    hold: "#2f6fdf", wait: "#f0a020", timeout: "#b00020", stall: "#b00020", lost: "#b00020",
    rule_change: "#7a3fc0", mixed_backends: "#7a3fc0", unserialized: "#b00020",
    drop_count: "#d9534f", hold_drops: "#a02020", conntrack_refused: "#a02020", conntrack: "#999",
    rule_drops: "#e0603a", uncounted_drops: "#e0603a",
    refusal_count: "#c0399a", hold_refusals: "#80206a",
    stale_endpoint_open: "#b00020", stale_endpoint: "#e04a4a", endpoint_programmed: "#2a9d5c",
    ipvs: "#888", ipvs_drained: "#a0a000", other: "#666"
  };
  const used = [...new Set(d.marks.map((m) => m.kind))];
  for (const k of used) {
    const s = document.createElement("span"); s.className = "key";
    const i = document.createElement("i"); i.style.background = colors[k] || colors.other;
    s.appendChild(i); s.appendChild(document.createTextNode(k)); $("keys").appendChild(s);
  }
  const rankOf = new Map();
  for (const m of d.marks) { if (!rankOf.has(m.lane)) rankOf.set(m.lane, m.rank); }
  const lanes = [...rankOf.keys()].sort((a, b) => (rankOf.get(a) - rankOf.get(b)) || a.localeCompare(b));
  const laneOf = new Map(lanes.map((l, i) => [l, i]));
  const span = Math.max(1, ...d.marks.map((m) => m.end));
  const LABEL = 300, ROW = 22, AXIS = 26;
  let width = Math.max(900, document.body.clientWidth - 40);
  const NS = "http://www.w3.org/2000/svg";
  const el = (n, attrs) => { const e = document.createElementNS(NS, n); for (const k in attrs) e.setAttribute(k, attrs[k]); return e; };
  const tip = $("tip");
  function secs(ns) { return (ns / 1e9).toFixed(ns < 1e10 ? 2 : 1) + " s"; }
  function draw() {
    const chart = $("chart"); chart.textContent = "";
    const plot = width - LABEL - 20;
    const x = (ns) => LABEL + (ns / span) * plot;
    const svg = el("svg", { width: width, height: AXIS + lanes.length * ROW + 8 });
    const bg = el("g", {});
    lanes.forEach((name, i) => {
      bg.appendChild(el("rect", { class: "lanebg", x: 0, y: AXIS + i * ROW, width: width, height: ROW }));
      const t = el("text", { x: 6, y: AXIS + i * ROW + 15 }); t.textContent = name.length > 44 ? name.slice(0, 43) + "…" : name;
      const title = el("title", {}); title.textContent = name; t.appendChild(title);
      bg.appendChild(t);
    });
    svg.appendChild(bg);
    for (let k = 0; k <= 10; k++) {
      const ns = span * k / 10, px = x(ns);
      svg.appendChild(el("line", { x1: px, x2: px, y1: AXIS - 6, y2: AXIS + lanes.length * ROW, stroke: "#dde2e8" }));
      const t = el("text", { x: px + 2, y: 14, fill: "#556" }); t.textContent = "+" + secs(ns); svg.appendChild(t);
    }
    d.marks.forEach((m, i) => {
      const y = AXIS + laneOf.get(m.lane) * ROW + 4;
      const x0 = x(m.start), w = Math.max(3, x(m.end) - x0);
      const r = el("rect", { class: "mark", x: x0, y: y, width: w, height: ROW - 8, rx: 2, fill: colors[m.kind] || colors.other, "data-type": m.kind, "data-i": i });
      if (m.kind === "wait") r.setAttribute("fill-opacity", "0.75");
      r.addEventListener("mousemove", (ev) => { tip.textContent = "+" + secs(m.start) + "  " + m.text; tip.style.display = "block"; tip.style.left = Math.min(ev.clientX + 12, window.innerWidth - 660) + "px"; tip.style.top = (ev.clientY + 14) + "px"; });
      r.addEventListener("mouseleave", () => { tip.style.display = "none"; });
      r.addEventListener("click", () => { $("detail").textContent = m.text + "\n\n" + JSON.stringify(m.fact, null, 2); });
      svg.appendChild(r);
    });
    chart.appendChild(svg);
  }
  $("zin").onclick = () => { width = Math.min(width * 2, 200000); draw(); };
  $("zout").onclick = () => { width = Math.max(900, width / 2); draw(); };
  draw();
  document.body.setAttribute("data-ready", "1");
})();
</script>
</body></html>
"##;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::facts::RuleDropsFact;

    fn drops(rule: &str) -> Output {
        Output::RuleDrops(RuleDropsFact {
            ts_ns: 2_000_000_000,
            since_ns: 1_000_000_000,
            netns: 7,
            family: "ip".into(),
            table: "filter".into(),
            chain: "INPUT".into(),
            rule: rule.into(),
            packets: 3,
            bytes: 180,
            reset: false,
            owner: Some("kube-proxy".into()),
            chain_owner: None,
            added: None,
            dests: Vec::new(),
            hold: None,
            others: 0,
        })
    }

    /// A page carries its data as JSON nobody can break out of: a rule text with `</script>`
    /// and markup stays a string inside the data.
    #[test]
    fn the_page_is_whole_and_escaped() {
        let mut buf = Vec::new();
        {
            let mut sink = HtmlSink::new(&mut buf, "node</title>".into(), 0, 0);
            sink.output(&drops("-m comment --comment \"</script><b>x</b>\" -j DROP"))
                .unwrap();
            sink.summary(&crate::analysis::Analyzer::new(vec![]).summary(), true)
                .unwrap();
        }
        let page = String::from_utf8(buf).unwrap();
        assert!(page.starts_with("<!doctype html>"));
        assert!(page.trim_end().ends_with("</html>"));
        // One script element closes the data: the hostile one is escaped.
        assert_eq!(page.matches("</script>").count(), 2, "{page}");
        assert!(page.contains("\\u003c/script\\u003e\\u003cb\\u003ex"));
        assert!(page.contains("\"kind\":\"rule_drops\""));
        // Nothing is fetched: no URL but the SVG namespace.
        assert!(!page.contains("src=\"http"), "{page}");
        assert!(!page.contains("href=\"http"), "{page}");
    }
}
