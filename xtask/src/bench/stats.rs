//! Medians and spreads of repeated measurements, and number formatting for the tables.
use serde_json::{json, Value};

/// Repeated measurements of one quantity.
#[derive(Clone, Debug, Default)]
pub struct Dist {
    pub samples: Vec<f64>,
}

impl Dist {
    pub fn push(&mut self, v: f64) {
        if v.is_finite() {
            self.samples.push(v);
        }
    }

    fn sorted(&self) -> Vec<f64> {
        let mut v = self.samples.clone();
        v.sort_by(f64::total_cmp);
        v
    }

    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    pub fn median(&self) -> f64 {
        let v = self.sorted();
        match v.len() {
            0 => f64::NAN,
            n if n % 2 == 1 => v[n / 2],
            n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
        }
    }

    pub fn min(&self) -> f64 {
        self.sorted().first().copied().unwrap_or(f64::NAN)
    }

    pub fn max(&self) -> f64 {
        self.sorted().last().copied().unwrap_or(f64::NAN)
    }

    /// (max - min) / median, in percent: how far apart the runs were.
    pub fn spread_pct(&self) -> f64 {
        let m = self.median();
        if m == 0.0 {
            return 0.0;
        }
        (self.max() - self.min()) / m.abs() * 100.0
    }

    pub fn json(&self) -> Value {
        json!({
            "median": round3(self.median()),
            "min": round3(self.min()),
            "max": round3(self.max()),
            "spread_pct": round3(self.spread_pct()),
            "n": self.samples.len(),
            "samples": self.samples.iter().map(|&v| round3(v)).collect::<Vec<_>>(),
        })
    }

    /// `1,234 ±5%`: the median and the spread of the runs.
    pub fn show(&self) -> String {
        if self.is_empty() {
            return "-".into();
        }
        format!("{} ±{:.0}%", num(self.median()), self.spread_pct())
    }
}

fn round3(v: f64) -> Value {
    if v.is_finite() {
        json!((v * 1000.0).round() / 1000.0)
    } else {
        Value::Null
    }
}

/// A number for a table: thousands separators, decimals only for small values.
pub fn num(v: f64) -> String {
    if !v.is_finite() {
        return "-".into();
    }
    if v.abs() < 10.0 && v != 0.0 {
        return format!("{v:.2}");
    }
    if v.abs() < 100.0 {
        return format!("{v:.1}");
    }
    let neg = v < 0.0;
    let digits = format!("{:.0}", v.abs());
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    if neg {
        format!("-{out}")
    } else {
        out
    }
}

/// Prints rows as aligned columns (the first left-aligned, the rest right-aligned).
pub fn table(rows: &[Vec<String>]) {
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let width: Vec<usize> = (0..cols)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|s| s.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    for r in rows {
        let mut line = String::new();
        for (c, cell) in r.iter().enumerate() {
            let pad = width[c].saturating_sub(cell.chars().count());
            if c == 0 {
                line.push_str(cell);
                line.push_str(&" ".repeat(pad));
            } else {
                line.push_str("  ");
                line.push_str(&" ".repeat(pad));
                line.push_str(cell);
            }
        }
        println!("  {}", line.trim_end());
    }
}

/// Per BPF program: (ns per run, runs per unit).
pub type ProgDists = std::collections::BTreeMap<String, (Dist, Dist)>;

/// One run's BPF programs (name, runs, ns) over `units` units of work: the total ns per unit
/// into `total`, each program's ns per run and runs per unit into `progs`.
pub fn add_bpf_runs(
    total: &mut Dist,
    progs: &mut ProgDists,
    ran: Vec<(String, u64, u64)>,
    units: u64,
) {
    let per = |v: u64| v as f64 / units.max(1) as f64;
    total.push(per(ran.iter().map(|(_, _, ns)| ns).sum()));
    for (name, runs, ns) in ran {
        let e = progs.entry(name).or_default();
        e.0.push(ns as f64 / runs.max(1) as f64);
        e.1.push(per(runs));
    }
}

/// Each tracer's BPF programs per `unit` (a refused connection, a transaction): the tracer's
/// total, then each program's ns per run × runs per unit; programs that ran fewer than 0.01
/// times a unit left out. `tracers`: (name, total ns per unit, per program (ns per run, runs
/// per unit)).
pub fn bpf_programs_table(unit: &str, tracers: &[(&str, &Dist, &ProgDists)]) {
    let mut rows = vec![vec![
        "tracer / program".to_string(),
        "ns/run".into(),
        format!("runs/{unit}"),
        format!("ns/{unit}"),
    ]];
    for (name, total, progs) in tracers {
        rows.push(vec![
            format!("{name} (all its programs)"),
            "".into(),
            "".into(),
            total.show(),
        ]);
        for (prog, (ns, runs)) in progs.iter() {
            if runs.median() < 0.01 {
                continue;
            }
            rows.push(vec![
                format!("  {prog}"),
                ns.show(),
                format!("{:.2}", runs.median()),
                format!("{:.0}", ns.median() * runs.median()),
            ]);
        }
    }
    table(&rows);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_spread() {
        let mut d = Dist::default();
        for v in [5.0, 1.0, 3.0, f64::NAN] {
            d.push(v);
        }
        assert_eq!(d.median(), 3.0);
        assert_eq!((d.min(), d.max()), (1.0, 5.0));
        assert!((d.spread_pct() - 133.333).abs() < 0.01);
        d.push(4.0);
        assert_eq!(d.median(), 3.5);
        assert!(Dist::default().median().is_nan());
    }

    #[test]
    fn numbers() {
        assert_eq!(num(1234567.0), "1,234,567");
        assert_eq!(num(123.4), "123");
        assert_eq!(num(12.34), "12.3");
        assert_eq!(num(1.234), "1.23");
        assert_eq!(num(-4321.0), "-4,321");
        assert_eq!(num(0.0), "0.0");
    }
}
