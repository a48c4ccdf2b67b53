//! Resource quantities (`500m`, `128Mi`, `1e3`), as far as the downward API
//! needs them: a value and a divisor, rounded up as kubelet rounds them.

use anyhow::{Context, bail};

/// A parsed quantity.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Quantity(f64);

impl Quantity {
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        let text = text.trim();
        let split = text
            .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+' || c == '-'))
            .unwrap_or(text.len());
        let (number, suffix) = text.split_at(split);
        let number: f64 = number
            .parse()
            .with_context(|| format!("{text:?} is not a quantity"))?;
        let factor = match suffix {
            "" => 1.0,
            "n" => 1e-9,
            "u" => 1e-6,
            "m" => 1e-3,
            "k" => 1e3,
            "M" => 1e6,
            "G" => 1e9,
            "T" => 1e12,
            "P" => 1e15,
            "E" => 1e18,
            "Ki" => 1024.0,
            "Mi" => 1024.0_f64.powi(2),
            "Gi" => 1024.0_f64.powi(3),
            "Ti" => 1024.0_f64.powi(4),
            "Pi" => 1024.0_f64.powi(5),
            "Ei" => 1024.0_f64.powi(6),
            exp if exp.starts_with(['e', 'E']) => {
                let power: i32 = exp[1..]
                    .parse()
                    .with_context(|| format!("{text:?} is not a quantity"))?;
                10.0_f64.powi(power)
            }
            _ => bail!("{text:?} is not a quantity (unknown suffix {suffix:?})"),
        };
        Ok(Self(number * factor))
    }

    /// `ceil(self / divisor)`, in whole units, as the downward API reports
    /// a resource (cpu: in millicores first, as kubelet computes it).
    pub fn divided_by(self, divisor: Self, cpu: bool) -> anyhow::Result<i64> {
        if divisor.0 <= 0.0 {
            bail!("the divisor must be positive");
        }
        let (value, divisor) = if cpu {
            ((self.0 * 1000.0).ceil(), (divisor.0 * 1000.0).ceil())
        } else {
            (self.0.ceil(), divisor.0.ceil())
        };
        #[expect(
            clippy::cast_possible_truncation,
            reason = "resource values fit an i64, as in Kubernetes"
        )]
        Ok((value / divisor).ceil() as i64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(text: &str) -> Quantity {
        Quantity::parse(text).unwrap()
    }

    #[test]
    fn suffixes_scale_the_number() {
        assert_eq!(q("500m"), Quantity(0.5));
        assert_eq!(q("128Mi"), Quantity(134_217_728.0));
        assert_eq!(q("1G"), Quantity(1e9));
        assert_eq!(q("2"), Quantity(2.0));
        assert_eq!(q("1e3"), Quantity(1000.0));
        assert!(Quantity::parse("12 apples").is_err());
        assert!(Quantity::parse("").is_err());
    }

    #[test]
    fn values_are_divided_and_rounded_up_as_kubelet_does() {
        assert_eq!(q("500m").divided_by(q("1"), true).unwrap(), 1);
        assert_eq!(q("500m").divided_by(q("1m"), true).unwrap(), 500);
        assert_eq!(q("2").divided_by(q("1"), true).unwrap(), 2);
        assert_eq!(q("128Mi").divided_by(q("1Mi"), false).unwrap(), 128);
        assert_eq!(q("100M").divided_by(q("1Mi"), false).unwrap(), 96);
        assert!(q("1").divided_by(q("0"), false).is_err());
    }
}
