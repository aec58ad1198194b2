package dev.cbserve.client;

import java.math.BigDecimal;
import java.util.function.DoublePredicate;

/**
 * Refusals of a request value in the server's own words: the wire field, the bound and the value
 * ({@code sampling.max_new_tokens must be an int >= 1, got 0}), as the server's validation writes
 * them, so that one mistake reads the same from the Java, Go and Python SDKs and from the server.
 * The builders throw them as {@link IllegalArgumentException}s before anything is sent.
 */
final class ServerWording {
  private ServerWording() {}

  /** Refuses an int outside [min, max] (max null: none); {@code note} follows the bound. */
  static int checkInt(String field, long value, long min, Long max, String note) {
    if (value < min || (max != null && value > max)) {
      String bounds = max == null ? ">= " + min : "in [" + min + ", " + max + "]";
      throw new IllegalArgumentException(
          field + " must be an int " + bounds + note + ", got " + value);
    }
    return (int) value;
  }

  /** Refuses an int below min. */
  static int checkInt(String field, long value, long min) {
    return checkInt(field, value, min, null, "");
  }

  /** Refuses NaN, an infinity, or a number outside bounds (phrased as the server does). */
  static float checkNumber(String field, double value, String bounds, DoublePredicate inBounds) {
    if (!Double.isFinite(value) || !inBounds.test(value)) {
      throw new IllegalArgumentException(
          field + " must be a finite number " + bounds + ", got " + pythonFloat(value));
    }
    return (float) value;
  }

  /** A number as the server writes a bound: 2 for 2.0, 0.5 for 0.5 (Python's {@code :g}). */
  static String bound(double value) {
    return value == Math.rint(value) && Math.abs(value) < 1e15
        ? Long.toString((long) value)
        : Double.toString(value);
  }

  /**
   * {@code value} as Python's {@code repr} writes a float, which is how the server writes the value
   * it refuses: -1.0, 0.5, 1e-05, 1e+16, nan, inf.
   */
  static String pythonFloat(double value) {
    if (Double.isNaN(value)) {
      return "nan";
    }
    if (Double.isInfinite(value)) {
      return value > 0 ? "inf" : "-inf";
    }
    if (value == 0) {
      return 1 / value < 0 ? "-0.0" : "0.0";
    }
    BigDecimal decimal = new BigDecimal(Double.toString(value)).stripTrailingZeros();
    int exponent = decimal.precision() - decimal.scale() - 1;
    if (exponent >= -4 && exponent < 16) {
      String plain = decimal.toPlainString();
      return plain.contains(".") ? plain : plain + ".0";
    }
    String digits = decimal.unscaledValue().abs().toString();
    String mantissa = digits.length() == 1 ? digits : digits.charAt(0) + "." + digits.substring(1);
    return (value < 0 ? "-" : "")
        + mantissa
        + "e"
        + (exponent < 0 ? "-" : "+")
        + String.format("%02d", Math.abs(exponent));
  }
}
