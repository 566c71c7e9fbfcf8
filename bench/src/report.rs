//! The one result format every benchmark ends with: a line
//! `RESULT name=<bench> <metric>=<value> ... ratio=<value>` on stdout and the
//! same as JSON in `target/rivet-bench/<bench>.json`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Serialize;

/// A benchmark's result: named metrics plus the ratio against its peer.
#[derive(Debug, Clone, Serialize)]
pub struct BenchResult {
    /// Benchmark name.
    pub name: String,
    /// Metrics in print order.
    pub metrics: Vec<(String, f64)>,
    /// Our number divided by the peer's, oriented as documented per bench.
    pub ratio: f64,
}

impl BenchResult {
    /// The `RESULT ...` line.
    pub fn line(&self) -> String {
        let mut line = format!("RESULT name={}", self.name);
        for (k, v) in &self.metrics {
            line.push_str(&format!(" {k}={}", fmt(*v)));
        }
        line.push_str(&format!(" ratio={}", fmt(self.ratio)));
        line
    }

    /// Prints the line and writes `<target>/rivet-bench/<name>.json`.
    pub fn publish(&self, target_dir: &Path) -> anyhow::Result<PathBuf> {
        let dir = target_dir.join("rivet-bench");
        std::fs::create_dir_all(&dir)?;
        let path = dir.join(format!("{}.json", self.name));
        let mut json = serde_json::Map::new();
        json.insert("name".into(), self.name.clone().into());
        for (k, v) in &self.metrics {
            json.insert(k.clone(), (*v).into());
        }
        json.insert("ratio".into(), self.ratio.into());
        std::fs::write(&path, serde_json::to_vec_pretty(&json)?)?;
        println!("{}", self.line());
        Ok(path)
    }
}

fn fmt(v: f64) -> String {
    if v.abs() >= 100.0 || v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.3}")
    }
}

/// The cargo target dir holding the running benchmark binary
/// (`<target>/<profile>/rivet-bench`).
pub fn target_dir() -> anyhow::Result<PathBuf> {
    if let Some(dir) = std::env::var_os("CARGO_TARGET_DIR") {
        return Ok(PathBuf::from(dir));
    }
    let exe = std::env::current_exe()?;
    exe.parent()
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .ok_or_else(|| anyhow::anyhow!("cannot find the target dir from {}", exe.display()))
}

/// A binary of this workspace built in the same profile as the benchmark.
pub fn sibling_binary(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let path = exe.with_file_name(name);
    anyhow::ensure!(
        path.exists(),
        "{} is missing: build the workspace binaries in the benchmark's profile first (cargo xtask bench does)",
        path.display()
    );
    Ok(path)
}

/// The machine's 1-minute load average (`/proc/loadavg`), printed beside
/// figures that the machine's load moves.
pub fn load_average() -> anyhow::Result<f64> {
    let text = std::fs::read_to_string("/proc/loadavg")?;
    text.split_whitespace()
        .next()
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("/proc/loadavg reads {text:?}"))
}

/// The median of per-round ratios and their spread (the lowest and the
/// highest): rounds of the compared runs taken back to back, so that the
/// machine's drifting load weighs on both sides of each ratio alike.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spread {
    /// The median (the mean of the middle two for an even count).
    pub median: f64,
    /// The lowest value.
    pub min: f64,
    /// The highest value.
    pub max: f64,
}

impl Spread {
    /// The spread of `values`; NaN everywhere when empty.
    pub fn of(values: Vec<f64>) -> Self {
        if values.is_empty() {
            return Self {
                median: f64::NAN,
                min: f64::NAN,
                max: f64::NAN,
            };
        }
        Self {
            min: values.iter().copied().fold(f64::INFINITY, f64::min),
            max: values.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            median: crate::datapath::median(values),
        }
    }
}

impl std::fmt::Display for Spread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:.3}x ({:.3}-{:.3})", self.median, self.min, self.max)
    }
}

/// A duration in milliseconds.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The `q` quantile (nearest rank) of `values` (sorts them); NaN when empty.
pub fn percentile(values: &mut [f64], q: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(f64::total_cmp);
    let rank = (values.len() as f64 * q).ceil() as usize;
    values[rank.clamp(1, values.len()) - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentile_is_nearest_rank() {
        let mut v: Vec<f64> = (1..=200).map(f64::from).collect();
        assert_eq!(percentile(&mut v, 0.50), 100.0);
        assert_eq!(percentile(&mut v, 0.99), 198.0);
        assert_eq!(percentile(&mut [3.0], 0.99), 3.0);
        assert!(percentile(&mut [], 0.5).is_nan());
    }

    #[test]
    fn a_spread_is_the_median_with_the_extremes() {
        let s = Spread::of(vec![1.2, 0.5, 1.0, 0.9]);
        assert_eq!((s.median, s.min, s.max), (0.95, 0.5, 1.2));
        assert_eq!(s.to_string(), "0.950x (0.500-1.200)");
        assert!(Spread::of(Vec::new()).median.is_nan());
    }

    #[test]
    fn result_line_and_json_match() {
        let r = BenchResult {
            name: "x".into(),
            metrics: vec![("a_per_s".into(), 1234.4), ("b_ms".into(), 0.5), ("n".into(), 8.0)],
            ratio: 0.25,
        };
        assert_eq!(r.line(), "RESULT name=x a_per_s=1234 b_ms=0.500 n=8 ratio=0.250");
        let dir = tempfile::tempdir().unwrap();
        let path = r.publish(dir.path()).unwrap();
        let json: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        assert_eq!(json["ratio"], 0.25);
        assert_eq!(json["a_per_s"], 1234.4);
    }
}
