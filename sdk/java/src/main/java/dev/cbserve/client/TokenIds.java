package dev.cbserve.client;

import java.util.AbstractList;
import java.util.Arrays;
import java.util.Objects;
import java.util.RandomAccess;
import java.util.stream.IntStream;

/**
 * An immutable list of token ids stored as an {@code int[]}: read it without boxing with {@link
 * #getInt(int)}, {@link #toIntArray()} or {@link #intStream()}. It is also a {@code List<Integer>}
 * (equal to any list of the same ids), for code that wants one.
 */
public final class TokenIds extends AbstractList<Integer> implements RandomAccess {
  private static final TokenIds EMPTY = new TokenIds(new int[0]);

  private final int[] ids;

  private TokenIds(int[] ids) {
    this.ids = ids;
  }

  /** The ids, copied. */
  public static TokenIds of(int... ids) {
    return ids.length == 0 ? EMPTY : new TokenIds(Objects.requireNonNull(ids, "ids").clone());
  }

  /** No ids. */
  public static TokenIds empty() {
    return EMPTY;
  }

  /** Takes ownership of {@code ids} (the caller must not change it afterwards). */
  static TokenIds wrap(int[] ids) {
    return ids.length == 0 ? EMPTY : new TokenIds(ids);
  }

  /** The id at {@code index}, unboxed. */
  public int getInt(int index) {
    Objects.checkIndex(index, ids.length);
    return ids[index];
  }

  /** The ids as a new array. */
  public int[] toIntArray() {
    return ids.clone();
  }

  /** The ids as a stream of ints. */
  public IntStream intStream() {
    return Arrays.stream(ids);
  }

  /** The ids from {@code from} (inclusive) to {@code to} (exclusive), copied. */
  public TokenIds slice(int from, int to) {
    Objects.checkFromToIndex(from, to, ids.length);
    return wrap(Arrays.copyOfRange(ids, from, to));
  }

  @Override
  public Integer get(int index) {
    return getInt(index);
  }

  @Override
  public int size() {
    return ids.length;
  }

  @Override
  public boolean equals(Object other) {
    if (other instanceof TokenIds that) {
      return Arrays.equals(ids, that.ids);
    }
    return super.equals(other);
  }

  @Override
  public int hashCode() {
    return super.hashCode(); // List's hash, so that it agrees with equal lists of Integers
  }

  @Override
  public String toString() {
    return Arrays.toString(ids);
  }
}
