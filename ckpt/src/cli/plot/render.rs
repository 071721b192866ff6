//! A tiny 2-d drawing surface with two backends: hand-written SVG, and PNG rasterized by
//! tiny-skia with text from an embedded font (DejaVu Sans, subset), so plots render the same
//! on a machine without any fonts installed. Charts are drawn once against [`Canvas`].

use std::fmt::Write as _;

use ab_glyph::{Font, FontRef, PxScale, ScaleFont};
use tiny_skia::{
    FillRule, LineCap, LineJoin, Paint, PathBuilder, Pixmap, PremultipliedColorU8, Rect, Stroke,
    StrokeDash, Transform,
};

/// The embedded font (see `assets/DejaVuSans-LICENSE.txt`).
pub const FONT: &[u8] = include_bytes!("../../../assets/DejaVuSans-subset.ttf");

/// An sRGB colour with alpha.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Color(pub u8, pub u8, pub u8, pub u8);

impl Color {
    /// Opaque.
    pub const fn rgb(r: u8, g: u8, b: u8) -> Self {
        Color(r, g, b, 255)
    }
    fn css(self) -> String {
        if self.3 == 255 {
            format!("#{:02x}{:02x}{:02x}", self.0, self.1, self.2)
        } else {
            format!(
                "rgba({},{},{},{:.3})",
                self.0,
                self.1,
                self.2,
                self.3 as f32 / 255.0
            )
        }
    }
    fn skia(self) -> tiny_skia::Color {
        tiny_skia::Color::from_rgba8(self.0, self.1, self.2, self.3)
    }
}

/// Where text sits relative to its point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Anchor {
    /// The point is the start of the text.
    Start,
    /// The point is the middle.
    Middle,
    /// The point is the end.
    End,
}

/// A line's look.
#[derive(Debug, Clone, PartialEq)]
pub struct Pen {
    /// Colour.
    pub color: Color,
    /// Width in pixels.
    pub width: f32,
    /// Dash pattern (on, off, ...), if dashed.
    pub dash: Option<Vec<f32>>,
}

impl Pen {
    /// A solid line.
    pub fn solid(color: Color, width: f32) -> Self {
        Pen {
            color,
            width,
            dash: None,
        }
    }
    /// A dashed line.
    pub fn dashed(color: Color, width: f32, dash: &[f32]) -> Self {
        Pen {
            color,
            width,
            dash: Some(dash.to_vec()),
        }
    }
}

/// What charts draw on. Coordinates are pixels, y down; text `y` is the baseline.
pub trait Canvas {
    /// Width and height.
    fn size(&self) -> (f32, f32);
    /// A polyline.
    fn line(&mut self, pts: &[(f32, f32)], pen: &Pen);
    /// A rectangle, filled and/or outlined.
    fn rect(&mut self, x: f32, y: f32, w: f32, h: f32, fill: Option<Color>, stroke: Option<&Pen>);
    /// A filled polygon, optionally outlined.
    fn polygon(&mut self, pts: &[(f32, f32)], fill: Color, stroke: Option<&Pen>);
    /// A filled circle, optionally outlined.
    fn circle(&mut self, cx: f32, cy: f32, r: f32, fill: Color, stroke: Option<&Pen>);
    /// Text; `vertical` turns it 90° counter-clockwise (reading upwards).
    fn text(
        &mut self,
        x: f32,
        y: f32,
        s: &str,
        size: f32,
        color: Color,
        anchor: Anchor,
        vertical: bool,
    );
}

fn font() -> FontRef<'static> {
    FontRef::try_from_slice(FONT).expect("the embedded font parses")
}

/// ab_glyph scales to the font's height (ascent - descent); CSS `font-size` is the em size.
/// Converting keeps PNG text the size SVG viewers draw it.
fn em_scale(f: &FontRef<'_>, size: f32) -> PxScale {
    PxScale::from(size * f.height_unscaled() / f.units_per_em().unwrap_or(2048.0))
}

/// Width of `s` at `size` px (em) in the embedded font (used by both backends for layout).
pub fn text_width(s: &str, size: f32) -> f32 {
    let f = font();
    let sf = f.as_scaled(em_scale(&f, size));
    let mut w = 0.0;
    let mut prev = None;
    for c in s.chars() {
        let g = sf.glyph_id(c);
        if let Some(p) = prev {
            w += sf.kern(p, g);
        }
        w += sf.h_advance(g);
        prev = Some(g);
    }
    w
}

fn anchor_shift(a: Anchor, w: f32) -> f32 {
    match a {
        Anchor::Start => 0.0,
        Anchor::Middle => -w / 2.0,
        Anchor::End => -w,
    }
}

// ----- SVG ------------------------------------------------------------------------------------

/// Builds an SVG document.
pub struct Svg {
    w: f32,
    h: f32,
    body: String,
}

fn xml_escape(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&apos;"),
            // Characters XML 1.0 cannot hold at all.
            c if (c as u32) < 0x20 && !matches!(c, '\t' | '\n' | '\r') => o.push('\u{fffd}'),
            c => o.push(c),
        }
    }
    o
}

fn pen_attrs(p: &Pen) -> String {
    let mut s = format!(
        r#" stroke="{}" stroke-width="{:.2}" stroke-linecap="round" stroke-linejoin="round""#,
        p.color.css(),
        p.width
    );
    if let Some(d) = &p.dash {
        let d: Vec<String> = d.iter().map(|x| format!("{x:.1}")).collect();
        let _ = write!(s, r#" stroke-dasharray="{}""#, d.join(","));
    }
    s
}

impl Svg {
    /// An empty document with a white background.
    pub fn new(w: f32, h: f32) -> Self {
        let mut s = Svg {
            w,
            h,
            body: String::new(),
        };
        s.rect(0.0, 0.0, w, h, Some(Color::rgb(255, 255, 255)), None);
        s
    }

    /// The finished document.
    pub fn finish(self) -> String {
        format!(
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg xmlns=\"http://www.w3.org/2000/svg\" \
             width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\" \
             font-family=\"DejaVu Sans, Verdana, Arial, sans-serif\">\n{}</svg>\n",
            self.body,
            w = self.w,
            h = self.h
        )
    }
}

fn pts_attr(pts: &[(f32, f32)]) -> String {
    let mut s = String::with_capacity(pts.len() * 14);
    for (i, (x, y)) in pts.iter().enumerate() {
        if i > 0 {
            s.push(' ');
        }
        let _ = write!(s, "{x:.1},{y:.1}");
    }
    s
}

impl Canvas for Svg {
    fn size(&self) -> (f32, f32) {
        (self.w, self.h)
    }
    fn line(&mut self, pts: &[(f32, f32)], pen: &Pen) {
        if pts.len() < 2 {
            return;
        }
        let _ = writeln!(
            self.body,
            r#"<polyline fill="none"{} points="{}"/>"#,
            pen_attrs(pen),
            pts_attr(pts)
        );
    }
    fn rect(&mut self, x: f32, y: f32, w: f32, h: f32, fill: Option<Color>, stroke: Option<&Pen>) {
        let _ = writeln!(
            self.body,
            r#"<rect x="{x:.1}" y="{y:.1}" width="{w:.1}" height="{h:.1}" fill="{}"{}/>"#,
            fill.map_or("none".into(), Color::css),
            stroke.map_or(String::new(), pen_attrs)
        );
    }
    fn polygon(&mut self, pts: &[(f32, f32)], fill: Color, stroke: Option<&Pen>) {
        let _ = writeln!(
            self.body,
            r#"<polygon fill="{}"{} points="{}"/>"#,
            fill.css(),
            stroke.map_or(String::new(), pen_attrs),
            pts_attr(pts)
        );
    }
    fn circle(&mut self, cx: f32, cy: f32, r: f32, fill: Color, stroke: Option<&Pen>) {
        let _ = writeln!(
            self.body,
            r#"<circle cx="{cx:.1}" cy="{cy:.1}" r="{r:.1}" fill="{}"{}/>"#,
            fill.css(),
            stroke.map_or(String::new(), pen_attrs)
        );
    }
    fn text(
        &mut self,
        x: f32,
        y: f32,
        s: &str,
        size: f32,
        color: Color,
        anchor: Anchor,
        vertical: bool,
    ) {
        let a = match anchor {
            Anchor::Start => "start",
            Anchor::Middle => "middle",
            Anchor::End => "end",
        };
        let rot = if vertical {
            format!(r#" transform="rotate(-90 {x:.1} {y:.1})""#)
        } else {
            String::new()
        };
        let _ = writeln!(
            self.body,
            r#"<text x="{x:.1}" y="{y:.1}" font-size="{size:.1}" fill="{}" text-anchor="{a}"{rot}>{}</text>"#,
            color.css(),
            xml_escape(s)
        );
    }
}

// ----- PNG ------------------------------------------------------------------------------------

/// Rasterizes into a pixmap.
pub struct Png {
    pix: Pixmap,
    font: FontRef<'static>,
}

impl Png {
    /// A white image of `w` x `h` pixels.
    pub fn new(w: u32, h: u32) -> Self {
        let mut pix = Pixmap::new(w.max(1), h.max(1)).expect("a non-empty pixmap");
        pix.fill(tiny_skia::Color::WHITE);
        Png { pix, font: font() }
    }

    /// The encoded PNG.
    pub fn finish(self) -> Result<Vec<u8>, String> {
        self.pix.encode_png().map_err(|e| e.to_string())
    }

    fn paint(c: Color) -> Paint<'static> {
        let mut p = Paint::default();
        p.set_color(c.skia());
        p.anti_alias = true;
        p
    }

    fn stroke_of(pen: &Pen) -> Stroke {
        Stroke {
            width: pen.width,
            line_cap: LineCap::Round,
            line_join: LineJoin::Round,
            dash: pen
                .dash
                .as_ref()
                .and_then(|d| StrokeDash::new(d.clone(), 0.0)),
            ..Stroke::default()
        }
    }

    /// Stroke `path` with `pen`.
    fn stroke(&mut self, path: &tiny_skia::Path, pen: &Pen) {
        self.pix.stroke_path(
            path,
            &Self::paint(pen.color),
            &Self::stroke_of(pen),
            Transform::identity(),
            None,
        );
    }

    /// Fill `path` with `fill`, then stroke it with `stroke` if given.
    fn fill_and_stroke(&mut self, path: &tiny_skia::Path, fill: Color, stroke: Option<&Pen>) {
        self.pix.fill_path(
            path,
            &Self::paint(fill),
            FillRule::Winding,
            Transform::identity(),
            None,
        );
        if let Some(p) = stroke {
            self.stroke(path, p);
        }
    }

    fn blend(&mut self, x: i32, y: i32, cov: f32, c: Color) {
        let (w, h) = (self.pix.width() as i32, self.pix.height() as i32);
        if x < 0 || y < 0 || x >= w || y >= h || cov <= 0.0 {
            return;
        }
        let a = (c.3 as f32 / 255.0) * cov.min(1.0);
        let i = (y * w + x) as usize;
        let px = &mut self.pix.pixels_mut()[i];
        let mix = |s: u8, d: u8| -> f32 { s as f32 * a + d as f32 * (1.0 - a) };
        let na = (a * 255.0 + px.alpha() as f32 * (1.0 - a))
            .round()
            .clamp(0.0, 255.0) as u8;
        let ch = |v: f32| (v.round().clamp(0.0, na as f32)) as u8;
        let r = ch(mix(c.0, px.red()));
        let g = ch(mix(c.1, px.green()));
        let b = ch(mix(c.2, px.blue()));
        if let Some(p) = PremultipliedColorU8::from_rgba(r, g, b, na) {
            *px = p;
        }
    }
}

impl Canvas for Png {
    fn size(&self) -> (f32, f32) {
        (self.pix.width() as f32, self.pix.height() as f32)
    }
    fn line(&mut self, pts: &[(f32, f32)], pen: &Pen) {
        if pts.len() < 2 {
            return;
        }
        let mut pb = PathBuilder::new();
        pb.move_to(pts[0].0, pts[0].1);
        for p in &pts[1..] {
            pb.line_to(p.0, p.1);
        }
        if let Some(path) = pb.finish() {
            self.stroke(&path, pen);
        }
    }
    fn rect(&mut self, x: f32, y: f32, w: f32, h: f32, fill: Option<Color>, stroke: Option<&Pen>) {
        let Some(r) = Rect::from_xywh(x, y, w.max(0.01), h.max(0.01)) else {
            return;
        };
        if let Some(f) = fill {
            self.pix
                .fill_rect(r, &Self::paint(f), Transform::identity(), None);
        }
        if let Some(p) = stroke {
            self.stroke(&PathBuilder::from_rect(r), p);
        }
    }
    fn polygon(&mut self, pts: &[(f32, f32)], fill: Color, stroke: Option<&Pen>) {
        if pts.len() < 3 {
            return;
        }
        let mut pb = PathBuilder::new();
        pb.move_to(pts[0].0, pts[0].1);
        for p in &pts[1..] {
            pb.line_to(p.0, p.1);
        }
        pb.close();
        if let Some(path) = pb.finish() {
            self.fill_and_stroke(&path, fill, stroke);
        }
    }
    fn circle(&mut self, cx: f32, cy: f32, r: f32, fill: Color, stroke: Option<&Pen>) {
        if let Some(path) = PathBuilder::from_circle(cx, cy, r) {
            self.fill_and_stroke(&path, fill, stroke);
        }
    }
    fn text(
        &mut self,
        x: f32,
        y: f32,
        s: &str,
        size: f32,
        color: Color,
        anchor: Anchor,
        vertical: bool,
    ) {
        let scale = em_scale(&self.font, size);
        let shift = anchor_shift(anchor, text_width(s, size));
        let mut pen_x = shift;
        let mut prev = None;
        let font = self.font.clone();
        let sf = font.as_scaled(scale);
        for ch in s.chars() {
            let gid = sf.glyph_id(ch);
            if let Some(p) = prev {
                pen_x += sf.kern(p, gid);
            }
            let glyph = gid.with_scale_and_position(scale, ab_glyph::point(pen_x, 0.0));
            pen_x += sf.h_advance(gid);
            prev = Some(gid);
            let Some(og) = font.outline_glyph(glyph) else {
                continue;
            };
            let b = og.px_bounds();
            let mut cov: Vec<(i32, i32, f32)> = Vec::new();
            og.draw(|gx, gy, c| {
                // Local coordinates: along the text, and down from the baseline.
                cov.push((b.min.x as i32 + gx as i32, b.min.y as i32 + gy as i32, c));
            });
            for (lx, ly, c) in cov {
                let (px, py) = if vertical {
                    (x as i32 + ly, y as i32 - lx)
                } else {
                    (x as i32 + lx, y as i32 + ly)
                };
                self.blend(px, py, c, color);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn font_has_the_glyphs_plots_use() {
        let f = font();
        for c in "Loss grad norm 0123456789.,:-+()@=→−×✕▲µ".chars() {
            assert_ne!(f.glyph_id(c).0, 0, "missing glyph {c:?}");
        }
        assert!(text_width("hello", 12.0) > 20.0);
    }

    #[test]
    fn svg_escapes_text_and_png_draws_ink() {
        let mut s = Svg::new(100.0, 50.0);
        s.text(
            10.0,
            20.0,
            "<a&b>\u{1}",
            12.0,
            Color::rgb(0, 0, 0),
            Anchor::Start,
            false,
        );
        let doc = s.finish();
        assert!(doc.contains("&lt;a&amp;b&gt;\u{fffd}"), "{doc}");
        let mut p = Png::new(60, 30);
        p.text(
            5.0,
            20.0,
            "Hi",
            16.0,
            Color::rgb(0, 0, 0),
            Anchor::Start,
            false,
        );
        p.line(
            &[(0.0, 25.0), (60.0, 25.0)],
            &Pen::solid(Color::rgb(255, 0, 0), 2.0),
        );
        let dark = p
            .pix
            .pixels()
            .iter()
            .filter(|px| px.red() < 100 && px.green() < 100)
            .count();
        assert!(dark > 20, "text drew {dark} dark pixels");
        let png = p.finish().unwrap();
        assert_eq!(&png[1..4], b"PNG");
    }
}
