//! Where everything goes on a canvas, and the y axes of its panels.

use super::scale::{Axis, time_step};
use super::series::{Point, Series, spike_points};

/// Where everything goes on a canvas: the plot area, its two panels (loss above, gradient
/// norm below when there is one) and the time scale.
pub(super) struct Frame {
    pub(super) h: f32,
    pub(super) left: f32,
    pub(super) right: f32,
    pub(super) plot_bottom: f32,
    pub(super) loss_top: f32,
    pub(super) loss_bottom: f32,
    pub(super) grad_top: f32,
    pub(super) grad_bottom: f32,
    pub(super) has_grad: bool,
    /// Seconds shown (at least 1).
    pub(super) span: f64,
    /// Seconds between time ticks.
    pub(super) tstep: f64,
}

impl Frame {
    pub(super) fn new((w, h): (f32, f32), s: &Series) -> Frame {
        let left = 74.0f32;
        let right = w - 24.0;
        let title_h = 54.0;
        let bottom_axis = 46.0;
        let has_grad = !s.grad_norm.is_empty();
        let plot_top = title_h + 8.0;
        let plot_bottom = h - bottom_axis;
        let gap = 18.0;
        let avail = plot_bottom - plot_top;
        let (loss_top, loss_bottom, grad_top, grad_bottom) = if has_grad {
            let lh = (avail - gap) * 0.7;
            (plot_top, plot_top + lh, plot_top + lh + gap, plot_bottom)
        } else {
            (plot_top, plot_bottom, plot_bottom, plot_bottom)
        };
        let span = s.span.max(1.0);
        let tstep = time_step(span, ((right - left) / 110.0).max(2.0) as usize);
        Frame {
            h,
            left,
            right,
            plot_bottom,
            loss_top,
            loss_bottom,
            grad_top,
            grad_bottom,
            has_grad,
            span,
            tstep,
        }
    }

    /// The x of `t` seconds after the start.
    pub(super) fn x_of(&self, t: f64) -> f32 {
        self.left + ((t / self.span) as f32) * (self.right - self.left)
    }

    /// The times of the time ticks.
    pub(super) fn time_ticks(&self) -> Vec<f64> {
        let mut out = Vec::new();
        let mut t = 0.0;
        while t <= self.span + 1e-9 {
            out.push(t);
            t += self.tstep;
        }
        out
    }
}

/// The y axes of the loss and gradient-norm panels. On a linear axis, spike steps stay out of
/// the range.
pub(super) fn axes(f: &Frame, s: &Series, log_y: bool) -> (Axis, Axis) {
    let spiky = spike_points(s);
    let in_range = |p: &&Point, log: bool| log || !spiky.contains(&(p.step, p.t.to_bits()));
    let loss_axis = Axis::new(
        s.loss
            .iter()
            .filter(|p| in_range(p, log_y))
            .map(|p| p.v)
            .chain(s.spikes.iter().filter_map(|m| m.v).filter(|_| log_y)),
        log_y,
        f.loss_top,
        f.loss_bottom,
    );
    let grad_axis = Axis::new(
        s.grad_norm
            .iter()
            .filter(|p| in_range(p, false))
            .map(|p| p.v),
        false,
        f.grad_top,
        f.grad_bottom,
    );
    (loss_axis, grad_axis)
}
