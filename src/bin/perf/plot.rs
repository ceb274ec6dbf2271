//! `--plot OUT.svg FILE...`: bus bandwidth against message size (log2 axis), one line per
//! input, as a self-contained SVG written by hand (no plotting library, no GPU).
//!
//! Inputs: this tool's `--json` files (out-of-place busbw), or text tables: the baselines'
//! format (`op size count type redop time algbw busbw ...`, one line per op in the file;
//! `FILE#op` keeps one op) and nccl-tests' own output (out-of-place columns).

use std::fmt::Write;

use crate::json::{self, Json};

struct Series {
    label: String,
    op: String,
    points: Vec<(f64, f64)>,
}

const OPS: [&str; 10] = ["allreduce", "allgather", "reducescatter", "bcast", "broadcast", "reduce", "alltoall",
                         "sendrecv", "gather", "scatter"];
const COLORS: [&str; 8] = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];

fn stem(path: &str) -> String {
    let name = path.rsplit('/').next().unwrap_or(path);
    name.split('.').next().unwrap_or(name).to_string()
}

fn from_json(path: &str, doc: &Json) -> Result<Series, String> {
    let rows = match doc.get("rows") {
        Some(Json::Arr(r)) => r,
        _ => return Err(format!("{path}: no \"rows\" array (not written by --json?)")),
    };
    let points = rows.iter().filter_map(|r| {
        // A table of in-place calls only (--in-place 1) has no out-of-place cell.
        let cell = r.get("out_of_place").or_else(|| r.get("in_place"))?;
        Some((r.get("size")?.num()?, cell.get("busbw")?.num()?))
    }).collect();
    let label = doc.get("label").and_then(|l| l.as_str()).map(String::from).unwrap_or_else(|| stem(path));
    let op = doc.get("collective").and_then(|l| l.as_str()).unwrap_or("").to_string();
    Ok(Series { label, op, points })
}

/// Series from a text table, one per op found (in order of first appearance).
fn from_table(path: &str, text: &str, only: Option<&str>) -> Vec<Series> {
    let mut out: Vec<Series> = Vec::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let (op, size, busbw) = if f.len() >= 8 && OPS.contains(&f[0]) {
            (f[0].to_string(), f[1].parse::<f64>(), f[7].parse::<f64>())
        } else if f.len() >= 13 && f[0].parse::<u64>().is_ok() {
            // nccl-tests: size count type redop root | time algbw busbw #wrong | in-place...
            (String::new(), f[0].parse::<f64>(), f[f.len() - 6].parse::<f64>())
        } else {
            continue;
        };
        let (Ok(size), Ok(busbw)) = (size, busbw) else { continue };
        if only.is_some_and(|o| o != op) {
            continue;
        }
        match out.iter_mut().find(|s| s.op == op) {
            Some(s) => s.points.push((size, busbw)),
            None => out.push(Series { label: String::new(), op, points: vec![(size, busbw)] }),
        }
    }
    let single = out.len() == 1;
    for s in &mut out {
        s.label = if single || s.op.is_empty() { stem(path) } else { format!("{} {}", stem(path), s.op) };
    }
    out
}

fn load(input: &str) -> Result<Vec<Series>, String> {
    let (path, only) = match input.rsplit_once('#') {
        Some((p, op)) if !std::path::Path::new(input).exists() => (p, Some(op)),
        _ => (input, None),
    };
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {path}: {e}"))?;
    let series = if text.trim_start().starts_with('{') {
        vec![from_json(path, &json::parse(&text).map_err(|e| format!("{path}: {e}"))?)?]
    } else {
        from_table(path, &text, only)
    };
    if series.iter().all(|s| s.points.is_empty()) {
        eprintln!("nccl-rs-perf: {input}: no rows to plot, left out");
    }
    Ok(series.into_iter().filter(|s| !s.points.is_empty()).collect())
}

pub fn run(out: &str, inputs: &[String]) -> Result<(), String> {
    let mut series = Vec::new();
    for i in inputs {
        series.extend(load(i)?);
    }
    if series.is_empty() {
        return Err("nothing to plot".into());
    }
    for s in &mut series {
        s.points.retain(|p| p.0 > 0.0 && p.1.is_finite());
        s.points.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    std::fs::write(out, svg(&series)).map_err(|e| format!("cannot write {out}: {e}"))?;
    eprintln!("nccl-rs-perf: wrote {out} ({} lines)", series.len());
    Ok(())
}

/// 8, 1K, 64M...: a power-of-two byte count in nccl-tests' units.
fn bytes_label(log2: i32) -> String {
    let (v, unit) = match log2 {
        i32::MIN..=9 => (1u64 << log2.max(0), ""),
        10..=19 => (1 << (log2 - 10), "K"),
        20..=29 => (1 << (log2 - 20), "M"),
        _ => (1 << (log2 - 30), "G"),
    };
    format!("{v}{unit}")
}

/// A round tick step (1, 2 or 5 times a power of ten) giving about `n` ticks up to `max`.
fn nice_step(max: f64, n: f64) -> f64 {
    let raw = (max / n).max(1e-9);
    let p = 10f64.powf(raw.log10().floor());
    let m = raw / p;
    p * if m <= 1.0 { 1.0 } else if m <= 2.0 { 2.0 } else if m <= 5.0 { 5.0 } else { 10.0 }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

fn svg(series: &[Series]) -> String {
    let (w, h) = (900.0, 540.0);
    let (l, r, t, b) = (70.0, 25.0, 50.0, 60.0);
    let pts = || series.iter().flat_map(|s| s.points.iter());
    let x0 = pts().map(|p| p.0.log2().floor() as i32).min().unwrap_or(3);
    let x1 = pts().map(|p| p.0.log2().ceil() as i32).max().unwrap_or(28).max(x0 + 1);
    let ymax_data = pts().map(|p| p.1).fold(0.0, f64::max);
    let ystep = nice_step(ymax_data * 1.05, 6.0);
    let ymax = (ymax_data * 1.05 / ystep).ceil().max(1.0) * ystep;
    let px = |size: f64| l + (size.log2() - x0 as f64) / (x1 - x0) as f64 * (w - l - r);
    let py = |bw: f64| h - b - bw / ymax * (h - t - b);
    let mut s = String::new();
    let _ = writeln!(s, r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#);
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let mut ops: Vec<&str> = Vec::new();
    for o in series.iter().map(|x| x.op.as_str()).filter(|o| !o.is_empty()) {
        if !ops.contains(&o) {
            ops.push(o);
        }
    }
    let title = format!("bus bandwidth vs message size{}", if ops.is_empty() { String::new() } else { format!(": {}", ops.join(", ")) });
    let _ = writeln!(s, r#"<text x="{}" y="28" text-anchor="middle" font-size="16">{}</text>"#, w / 2.0, esc(&title));
    // Grid and ticks.
    let xstep = ((x1 - x0) as f64 / 13.0).ceil().max(1.0) as i32;
    for k in (x0..=x1).filter(|k| (k - x0) % xstep == 0) {
        let x = px(2f64.powi(k));
        let _ = writeln!(s, r##"<line x1="{x:.1}" y1="{t}" x2="{x:.1}" y2="{}" stroke="#e0e0e0"/>"##, h - b);
        let _ = writeln!(s, r#"<text x="{x:.1}" y="{}" text-anchor="middle">{}</text>"#, h - b + 18.0, bytes_label(k));
    }
    let mut y = 0.0;
    while y <= ymax + ystep * 1e-6 {
        let yy = py(y);
        let _ = writeln!(s, r##"<line x1="{l}" y1="{yy:.1}" x2="{}" y2="{yy:.1}" stroke="#e0e0e0"/>"##, w - r);
        let _ = writeln!(s, r#"<text x="{}" y="{:.1}" text-anchor="end">{}</text>"#, l - 8.0, yy + 4.0, format_tick(y, ystep));
        y += ystep;
    }
    let _ = writeln!(s, r#"<rect x="{l}" y="{t}" width="{}" height="{}" fill="none" stroke="black"/>"#, w - l - r, h - t - b);
    let _ = writeln!(s, r#"<text x="{}" y="{}" text-anchor="middle">message size (bytes, log2 scale)</text>"#, (l + w - r) / 2.0, h - 15.0);
    let _ = writeln!(s, r#"<text transform="translate(20 {}) rotate(-90)" text-anchor="middle">busbw (GB/s, 1 GB = 1e9 B)</text>"#, (t + h - b) / 2.0);
    // Lines, markers and legend.
    for (i, se) in series.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        let dash = if i >= COLORS.len() { r#" stroke-dasharray="6 3""# } else { "" };
        let path: Vec<String> = se.points.iter().map(|p| format!("{:.1},{:.1}", px(p.0), py(p.1))).collect();
        let _ = writeln!(s, r#"<polyline points="{}" fill="none" stroke="{c}" stroke-width="2"{dash}/>"#, path.join(" "));
        for p in &se.points {
            let _ = writeln!(s, r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{c}"/>"#, px(p.0), py(p.1));
        }
    }
    let lw = 30.0 + 7.0 * series.iter().map(|x| x.label.chars().count()).max().unwrap_or(10) as f64;
    let (lx, ly) = (l + 12.0, t + 12.0);
    let _ = writeln!(s, r##"<rect x="{lx}" y="{ly}" width="{lw}" height="{}" fill="white" fill-opacity="0.9" stroke="#999"/>"##,
                     10.0 + 18.0 * series.len() as f64);
    for (i, se) in series.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        let yy = ly + 17.0 + 18.0 * i as f64;
        let _ = writeln!(s, r#"<line x1="{}" y1="{:.1}" x2="{}" y2="{:.1}" stroke="{c}" stroke-width="2"/>"#, lx + 6.0, yy - 4.0, lx + 24.0, yy - 4.0);
        let _ = writeln!(s, r#"<text x="{}" y="{yy:.1}">{}</text>"#, lx + 30.0, esc(&se.label));
    }
    s.push_str("</svg>\n");
    s
}

fn format_tick(y: f64, step: f64) -> String {
    if step >= 1.0 { format!("{y:.0}") } else if step >= 0.1 { format!("{y:.1}") } else { format!("{y:.2}") }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_baselines_table_and_nccl_tests_output() {
        let t = "# comment\nallreduce 8 2 float sum 10.0 0.001 0.001 9 11 200 0\nbcast 8 2 float none 5 0.002 0.002 4 6 200 0\n\
                 allreduce 1024 256 float sum 12.0 0.085 0.085 11 13 200 0\n";
        let s = from_table("/x/mpi.txt", t, None);
        assert_eq!(s.len(), 2);
        assert_eq!((s[0].label.as_str(), s[0].points.len()), ("mpi allreduce", 2));
        assert_eq!(from_table("/x/mpi.txt", t, Some("bcast"))[0].label, "mpi");
        let nt = "#  size count type redop root time algbw busbw #wrong time algbw busbw #wrong\n\
                  1048576 262144 float sum -1 100.0 10.49 15.73 0 99.0 10.6 15.9 0\n";
        let s = from_table("all_reduce_perf.out", nt, None);
        assert_eq!(s[0].points, vec![(1048576.0, 15.73)]);
    }

    #[test]
    fn axis_helpers() {
        assert_eq!(bytes_label(3), "8");
        assert_eq!(bytes_label(10), "1K");
        assert_eq!(bytes_label(26), "64M");
        assert_eq!(bytes_label(31), "2G");
        assert_eq!(nice_step(10.0, 5.0), 2.0);
        assert_eq!(nice_step(0.7, 6.0), 0.2);
    }
}
