//! Progress of long commands (`wait`, `bootstrap`) on stderr: an indicatif
//! bar on a terminal, plain lines otherwise (a log, CI), printed when what
//! they say changes and at most about once a second.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

pub struct Reporter {
    /// `wait`, `bootstrap`: starts every plain line.
    name: &'static str,
    bar: Option<ProgressBar>,
    last: String,
    last_at: Option<Instant>,
}

impl Reporter {
    /// A bar with a count (`counted`) or a spinner, when stderr is a
    /// terminal; plain lines when it is not.
    pub fn new(name: &'static str, counted: bool) -> Reporter {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = if counted {
                ProgressBar::new(0).with_style(
                    ProgressStyle::with_template(
                        "{spinner:.green} [{bar:24.cyan/blue}] {pos}/{len} machines started  {wide_msg}",
                    )
                    .expect("a valid template")
                    .progress_chars("=> "),
                )
            } else {
                ProgressBar::new_spinner().with_style(
                    ProgressStyle::with_template("{spinner:.green} {wide_msg}")
                        .expect("a valid template"),
                )
            };
            bar.set_draw_target(ProgressDrawTarget::stderr());
            bar.enable_steady_tick(Duration::from_millis(100));
            bar
        });
        Reporter {
            name,
            bar,
            last: String::new(),
            last_at: None,
        }
    }

    /// Shows the state: `count` is (done, total) for a counted bar, `msg`
    /// the rest, `line` the whole plain line.
    pub fn update(&mut self, count: Option<(u64, u64)>, msg: &str, line: &str) {
        match &self.bar {
            Some(bar) => {
                if let Some((done, total)) = count {
                    bar.set_length(total);
                    bar.set_position(done);
                }
                bar.set_message(msg.to_string());
            }
            None => {
                let due = self
                    .last_at
                    .is_none_or(|t| t.elapsed() >= Duration::from_secs(1));
                if line != self.last && due {
                    self.print(line);
                }
            }
        }
    }

    /// Always printed, above the bar on a terminal.
    pub fn line(&mut self, line: &str) {
        match &self.bar {
            Some(bar) => bar.println(line),
            None => self.print(line),
        }
    }

    fn print(&mut self, line: &str) {
        let _ = writeln!(std::io::stderr(), "{}: {line}", self.name);
        self.last = line.to_string();
        self.last_at = Some(Instant::now());
    }

    /// Ends the display with `line` as the last word (unless a plain
    /// display printed it already).
    pub fn finish(mut self, line: &str) {
        self.end(line);
    }

    fn end(&mut self, line: &str) {
        match self.bar.take() {
            Some(bar) => {
                bar.finish_and_clear();
                let _ = writeln!(std::io::stderr(), "{}: {line}", self.name);
            }
            None if self.last != line => self.print(line),
            None => {}
        }
    }
}

/// How `bootstrap` shows its progress.
impl jujube_controller::run::Progress for Reporter {
    fn line(&mut self, line: &str) {
        Reporter::line(self, line)
    }

    fn update(&mut self, msg: &str, line: &str) {
        Reporter::update(self, None, msg, line)
    }

    fn finish(&mut self, line: &str) {
        self.end(line)
    }
}

impl Drop for Reporter {
    fn drop(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }
}
