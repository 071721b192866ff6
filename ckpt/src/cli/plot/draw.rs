//! The chart drawn part by part: title, panels, time axis, events, curves, markers, legend.

use super::frame::{Frame, axes};
use super::render::{Anchor, Canvas, Color, Pen, text_width};
use super::scale::{Axis, elapsed_label, value_label};
use super::series::{Mark, Series, segments};
use crate::cli::shared::fmt;

const INK: Color = Color::rgb(40, 40, 48);
const MUTED: Color = Color::rgb(110, 110, 120);
const GRID: Color = Color::rgb(228, 228, 234);
const LOSS: Color = Color::rgb(31, 119, 180);
const GRAD: Color = Color::rgb(120, 81, 169);
const CKPT: Color = Color::rgb(44, 160, 44);
const FAIL: Color = Color::rgb(214, 39, 40);
const RECOVER: Color = Color::rgb(23, 190, 207);
const ROLLBACK: Color = Color::rgb(255, 127, 14);
const SPIKE: Color = Color::rgb(255, 127, 14);
const STOP: Color = Color::rgb(150, 20, 20);

/// Draw the chart of `s` on `c`.
pub fn draw(c: &mut dyn Canvas, run: &str, s: &Series, log_y: bool) {
    let f = Frame::new(c.size(), s);
    draw_title(c, &f, run, s);
    let (loss_axis, grad_axis) = axes(&f, s, log_y);
    draw_panels(c, &f, &loss_axis, &grad_axis);
    draw_time_axis(c, &f, s);
    draw_events(c, &f, s);
    draw_curves(c, &f, s, &loss_axis, &grad_axis);
    draw_markers(c, &f, s, &loss_axis);
    draw_legend(c, &f, run, s);
}

/// The title and the summary line under it.
fn draw_title(c: &mut dyn Canvas, f: &Frame, run: &str, s: &Series) {
    c.text(
        f.left,
        26.0,
        &format!("run {run}"),
        19.0,
        INK,
        Anchor::Start,
        false,
    );
    let first = s.loss.first().map(|p| p.v);
    let last = s.loss.last().map(|p| p.v);
    let mut summary = vec![];
    if let (Some(a), Some(b)) = (first, last) {
        summary.push(format!(
            "{} loss points, {} → {}",
            s.loss.len(),
            value_label(a),
            value_label(b)
        ));
    }
    for (n, one, many) in [
        (s.checkpoints.len(), "checkpoint", "checkpoints"),
        (s.failures.len(), "failure", "failures"),
        (s.recoveries.len(), "recovery", "recoveries"),
        (s.rollbacks.len(), "rollback", "rollbacks"),
        (s.spikes.len(), "loss spike", "loss spikes"),
        (s.stops.len(), "stop", "stops"),
    ] {
        if n == 0 && one == "stop" {
            continue;
        }
        summary.push(format!("{n} {}", if n == 1 { one } else { many }));
    }
    summary.push(format!("over {}", fmt::duration(s.span)));
    c.text(
        f.left,
        46.0,
        &summary.join(" · "),
        12.5,
        MUTED,
        Anchor::Start,
        false,
    );
}

/// Each panel's background, value grid and labels, time grid, name and border.
fn draw_panels(c: &mut dyn Canvas, f: &Frame, loss_axis: &Axis, grad_axis: &Axis) {
    let (left, right) = (f.left, f.right);
    let mut panels: Vec<(&Axis, &str)> = vec![(loss_axis, "loss")];
    if f.has_grad {
        panels.push((grad_axis, "grad norm"));
    }
    for (axis, name) in &panels {
        c.rect(
            left,
            axis.top,
            right - left,
            axis.bottom - axis.top,
            Some(Color::rgb(251, 251, 253)),
            None,
        );
        for v in axis.ticks() {
            let y = axis.y(v);
            if y < axis.top - 0.5 || y > axis.bottom + 0.5 {
                continue;
            }
            c.line(&[(left, y), (right, y)], &Pen::solid(GRID, 1.0));
            c.text(
                left - 8.0,
                y + 4.0,
                &value_label(v),
                11.0,
                MUTED,
                Anchor::End,
                false,
            );
        }
        for t in f.time_ticks() {
            let x = f.x_of(t);
            c.line(&[(x, axis.top), (x, axis.bottom)], &Pen::solid(GRID, 1.0));
        }
        c.text(
            18.0,
            (axis.top + axis.bottom) / 2.0,
            name,
            12.5,
            INK,
            Anchor::Middle,
            true,
        );
        c.rect(
            left,
            axis.top,
            right - left,
            axis.bottom - axis.top,
            None,
            Some(&Pen::solid(Color::rgb(190, 190, 200), 1.0)),
        );
    }
}

/// The time axis under the panels: ticks, elapsed-time labels and the start time.
fn draw_time_axis(c: &mut dyn Canvas, f: &Frame, s: &Series) {
    let plot_bottom = f.plot_bottom;
    for t in f.time_ticks() {
        let x = f.x_of(t);
        c.line(
            &[(x, plot_bottom), (x, plot_bottom + 5.0)],
            &Pen::solid(MUTED, 1.0),
        );
        c.text(
            x,
            plot_bottom + 18.0,
            &elapsed_label(t),
            11.0,
            MUTED,
            Anchor::Middle,
            false,
        );
    }
    let start = fmt::time_ms(s.t0_ms).replace('T', " ").replace('Z', " UTC");
    c.text(
        (f.left + f.right) / 2.0,
        f.h - 8.0,
        &format!("wall-clock time since {start}"),
        12.0,
        INK,
        Anchor::Middle,
        false,
    );
}

/// Events: vertical lines through both panels, labels at the top of the loss panel (spikes
/// get a label and no line: their marker sits on the curve).
fn draw_events(c: &mut dyn Canvas, f: &Frame, s: &Series) {
    let spike_labels: Vec<Mark> = s
        .spikes
        .iter()
        .map(|m| Mark {
            label: match m.v {
                Some(v) => format!("{} ({})", m.label, value_label(v)),
                None => m.label.clone(),
            },
            ..m.clone()
        })
        .collect();
    let mut events: Vec<(&Mark, Option<Pen>, Color)> = Vec::new();
    for m in &s.failures {
        events.push((m, Some(Pen::dashed(FAIL, 1.6, &[5.0, 4.0])), FAIL));
    }
    for m in &s.recoveries {
        events.push((m, Some(Pen::solid(RECOVER, 1.6)), Color::rgb(14, 130, 145)));
    }
    for m in &s.rollbacks {
        events.push((
            m,
            Some(Pen::dashed(ROLLBACK, 1.6, &[8.0, 3.0, 2.0, 3.0])),
            Color::rgb(200, 95, 0),
        ));
    }
    for m in &s.stops {
        events.push((m, Some(Pen::solid(STOP, 2.2)), STOP));
    }
    for m in &spike_labels {
        events.push((m, None, Color::rgb(200, 95, 0)));
    }
    events.sort_by(|a, b| a.0.t.total_cmp(&b.0.t));
    // Labels go in rows at the top of the loss panel: each in the first row where it does not
    // overlap the previous label, right of its line (left of it near the right edge).
    let mut row_end: Vec<f32> = Vec::new();
    for (m, pen, tc) in &events {
        let x = f.x_of(m.t);
        if let Some(pen) = pen {
            c.line(
                &[(x, f.loss_top), (x, f.grad_bottom.max(f.loss_bottom))],
                pen,
            );
        }
        let tw = text_width(&m.label, 11.0);
        let (x0, anchor) = if x + 3.0 + tw > f.right {
            (x - 3.0 - tw, Anchor::End)
        } else {
            (x + 3.0, Anchor::Start)
        };
        let row = match row_end.iter().position(|&e| e + 6.0 < x0) {
            Some(r) => r,
            None if row_end.len() < 6 => {
                row_end.push(f32::MIN);
                row_end.len() - 1
            }
            None => row_end.len() - 1,
        };
        row_end[row] = x0 + tw;
        let y = f.loss_top + 15.0 + 15.0 * row as f32;
        c.rect(
            x0 - 2.0,
            y - 10.5,
            tw + 4.0,
            13.5,
            Some(Color(255, 255, 255, 225)),
            None,
        );
        let tx = if anchor == Anchor::End { x0 + tw } else { x0 };
        c.text(tx, y, &m.label, 11.0, *tc, anchor, false);
    }
}

/// The loss and gradient-norm curves, one line per uninterrupted segment.
fn draw_curves(c: &mut dyn Canvas, f: &Frame, s: &Series, loss_axis: &Axis, grad_axis: &Axis) {
    for (pts, axis, color) in [(&s.loss, loss_axis, LOSS), (&s.grad_norm, grad_axis, GRAD)] {
        for seg in segments(pts) {
            // Clipped to the panel: spikes left out of the range run off its top.
            let px: Vec<(f32, f32)> = seg
                .iter()
                .filter(|p| !axis.log || p.v > 0.0)
                .map(|p| (f.x_of(p.t), axis.y(p.v).clamp(axis.top, axis.bottom)))
                .collect();
            let px = decimate(&px);
            if px.len() == 1 {
                c.circle(px[0].0, px[0].1, 2.0, color, None);
            }
            c.line(&px, &Pen::solid(color, 1.6));
        }
    }
}

/// Spikes as rings on the loss curve, checkpoints as triangles on the bottom edge of the loss
/// panel.
fn draw_markers(c: &mut dyn Canvas, f: &Frame, s: &Series, loss_axis: &Axis) {
    for m in &s.spikes {
        let x = f.x_of(m.t);
        let y = m.v.map_or(f.loss_top + 6.0, |v| {
            loss_axis.y(v).clamp(f.loss_top, f.loss_bottom)
        });
        c.circle(
            x,
            y,
            5.0,
            Color(255, 255, 255, 255),
            Some(&Pen::solid(SPIKE, 2.0)),
        );
    }
    for m in &s.checkpoints {
        let x = f.x_of(m.t);
        let y = f.loss_bottom;
        c.polygon(
            &[(x, y - 9.0), (x - 5.0, y), (x + 5.0, y)],
            CKPT,
            Some(&Pen::solid(Color::rgb(255, 255, 255), 0.8)),
        );
    }
}

/// The legend, top right (boxed inside the loss panel when the title leaves no room), only for
/// what is present.
fn draw_legend(c: &mut dyn Canvas, f: &Frame, run: &str, s: &Series) {
    let (left, right) = (f.left, f.right);
    let mut legend: Vec<(&str, u8, Color)> = vec![("loss", 0, LOSS)];
    if f.has_grad {
        legend.push(("grad norm", 0, GRAD));
    }
    if !s.checkpoints.is_empty() {
        legend.push(("checkpoint", 1, CKPT));
    }
    if !s.failures.is_empty() {
        legend.push(("failure", 2, FAIL));
    }
    if !s.recoveries.is_empty() {
        legend.push(("recovery", 0, RECOVER));
    }
    if !s.rollbacks.is_empty() {
        legend.push(("rollback", 3, ROLLBACK));
    }
    if !s.spikes.is_empty() {
        legend.push(("loss spike", 4, SPIKE));
    }
    if !s.stops.is_empty() {
        legend.push(("stop", 5, STOP));
    }
    let title_end = left + text_width(&format!("run {run}"), 19.0) + 24.0;
    let item_w = |n: &str| 30.0 + text_width(n, 11.5) + 16.0;
    let total: f32 = legend.iter().map(|(n, _, _)| item_w(n)).sum();
    let boxed = title_end + total > right;
    let (mut lx, ly) = if boxed {
        (right - total.min(right - left) - 6.0, f.loss_top + 6.0)
    } else {
        (right - total, 10.0)
    };
    if boxed {
        c.rect(
            lx - 6.0,
            ly,
            total + 6.0,
            22.0,
            Some(Color(255, 255, 255, 230)),
            Some(&Pen::solid(Color::rgb(210, 210, 218), 1.0)),
        );
    }
    for (name, kind, color) in &legend {
        let y = ly + 16.0;
        let (x0, x1) = (lx, lx + 24.0);
        let mid = (x0 + x1) / 2.0;
        match kind {
            0 => c.line(&[(x0, y - 4.0), (x1, y - 4.0)], &Pen::solid(*color, 2.0)),
            1 => c.polygon(
                &[(mid, y - 9.0), (mid - 5.0, y), (mid + 5.0, y)],
                *color,
                None,
            ),
            2 => c.line(
                &[(x0, y - 4.0), (x1, y - 4.0)],
                &Pen::dashed(*color, 2.0, &[5.0, 4.0]),
            ),
            3 => c.line(
                &[(x0, y - 4.0), (x1, y - 4.0)],
                &Pen::dashed(*color, 2.0, &[8.0, 3.0, 2.0, 3.0]),
            ),
            5 => c.line(&[(x0, y - 4.0), (x1, y - 4.0)], &Pen::solid(*color, 2.2)),
            _ => c.circle(
                mid,
                y - 4.0,
                4.5,
                Color::rgb(255, 255, 255),
                Some(&Pen::solid(*color, 2.0)),
            ),
        }
        c.text(x1 + 6.0, y, name, 11.5, INK, Anchor::Start, false);
        lx += item_w(name);
    }
}

/// Keep at most a few points per pixel column (first, min, max, last), so a million steps
/// draw as fast as a thousand and look the same.
fn decimate(pts: &[(f32, f32)]) -> Vec<(f32, f32)> {
    if pts.len() < 4000 {
        return pts.to_vec();
    }
    let mut out = Vec::new();
    let mut i = 0;
    while i < pts.len() {
        let col = pts[i].0.floor();
        let mut j = i;
        let (mut lo, mut hi) = (i, i);
        while j < pts.len() && pts[j].0.floor() == col {
            if pts[j].1 < pts[lo].1 {
                lo = j;
            }
            if pts[j].1 > pts[hi].1 {
                hi = j;
            }
            j += 1;
        }
        let mut idx = vec![i, lo, hi, j - 1];
        idx.sort_unstable();
        idx.dedup();
        out.extend(idx.into_iter().map(|k| pts[k]));
        i = j;
    }
    out
}
