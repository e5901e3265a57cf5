//! A scrape of the container's `/metrics`, parsed into samples, and the sums the checks ask of
//! it.
use std::collections::BTreeMap;

/// A scrape of `/metrics`: (name, labels, value) per sample.
pub struct Scrape(pub Vec<(String, BTreeMap<String, String>, f64)>);

impl Scrape {
    pub fn parse(text: &str) -> Self {
        let mut v = Vec::new();
        for line in text.lines() {
            if line.starts_with('#') || line.trim().is_empty() {
                continue;
            }
            let (series, value) = match line.rsplit_once(' ') {
                Some(x) => x,
                None => continue,
            };
            let Ok(value) = value.parse::<f64>() else {
                continue;
            };
            let (name, labels) = match series.split_once('{') {
                Some((n, rest)) => (n, parse_labels(rest.trim_end_matches('}'))),
                None => (series, BTreeMap::new()),
            };
            v.push((name.to_owned(), labels, value));
        }
        Scrape(v)
    }

    /// Values of `name` whose labels include all of `want`.
    pub fn values(&self, name: &str, want: &[(&str, &str)]) -> Vec<f64> {
        self.0
            .iter()
            .filter(|(n, l, _)| {
                n == name
                    && want
                        .iter()
                        .all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
            })
            .map(|s| s.2)
            .collect()
    }

    pub fn sum(&self, name: &str, want: &[(&str, &str)]) -> f64 {
        self.values(name, want).iter().sum()
    }

    pub fn series(&self, name: &str) -> Vec<&BTreeMap<String, String>> {
        self.0
            .iter()
            .filter(|s| s.0 == name)
            .map(|s| &s.1)
            .collect()
    }
}

fn parse_labels(s: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut rest = s;
    while let Some((k, r)) = rest.split_once("=\"") {
        let mut val = String::new();
        let mut chars = r.char_indices();
        let mut end = r.len();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    if let Some((_, n)) = chars.next() {
                        val.push(match n {
                            'n' => '\n',
                            other => other,
                        });
                    }
                }
                '"' => {
                    end = i + 1;
                    break;
                }
                c => val.push(c),
            }
        }
        out.insert(k.trim_start_matches(',').trim().to_owned(), val);
        rest = r[end..].trim_start_matches(',');
    }
    out
}
