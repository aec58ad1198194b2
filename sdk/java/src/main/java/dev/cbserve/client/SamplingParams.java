package dev.cbserve.client;

import cbserve.v1.Types;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Collections;
import java.util.List;
import java.util.Map;
import java.util.Objects;
import java.util.SortedMap;
import java.util.TreeMap;

/**
 * Sampling and stopping parameters of one request. Immutable; build with {@link #builder()}.
 *
 * <p>Every field is optional: an unset field takes the server's default (normally the model's
 * generation config), which is not the same as zero. {@code SamplingParams.defaults()} leaves them
 * all unset. The setters refuse values outside the server's bounds ({@link SamplingBounds}, the
 * table every SDK shares) with an {@link IllegalArgumentException} naming the value and the bound;
 * bounds that depend on the model (token ids below the vocabulary size, a tokenizer for stop
 * strings) are checked by the server ({@link InvalidArgumentException}).
 *
 * <pre>{@code
 * SamplingParams greedy = SamplingParams.builder().maxNewTokens(32).temperature(0).build();
 * }</pre>
 */
public final class SamplingParams {
  private static final SamplingParams DEFAULTS = new Builder().build();

  private final Integer maxNewTokens;
  private final Float temperature;
  private final Integer topK;
  private final Float topP;
  private final Long seed;
  private final int[] eos;
  private final boolean ignoreEos;
  private final boolean logprobs;
  private final Integer topLogprobs;
  private final List<String> stop;
  private final Float repetitionPenalty;
  private final Float presencePenalty;
  private final Float frequencyPenalty;
  private final Integer minNewTokens;
  private final SortedMap<Integer, Float> logitBias;

  private SamplingParams(Builder b) {
    this.maxNewTokens = b.maxNewTokens;
    this.temperature = b.temperature;
    this.topK = b.topK;
    this.topP = b.topP;
    this.seed = b.seed;
    this.eos = b.eos.clone();
    this.ignoreEos = b.ignoreEos;
    this.logprobs = b.logprobs;
    this.topLogprobs = b.topLogprobs;
    this.stop = b.stop;
    this.repetitionPenalty = b.repetitionPenalty;
    this.presencePenalty = b.presencePenalty;
    this.frequencyPenalty = b.frequencyPenalty;
    this.minNewTokens = b.minNewTokens;
    this.logitBias = b.logitBias;
  }

  /** All fields unset: the server's defaults. */
  public static SamplingParams defaults() {
    return DEFAULTS;
  }

  /** A new builder with every field unset. */
  public static Builder builder() {
    return new Builder();
  }

  /** Whether these parameters ask for logprobs (logprobs, or top logprobs above 0). */
  boolean wantsLogprobs() {
    return logprobs || (topLogprobs != null && topLogprobs > 0);
  }

  Types.SamplingParams toProto() {
    Types.SamplingParams.Builder p = Types.SamplingParams.newBuilder();
    if (maxNewTokens != null) {
      p.setMaxNewTokens(maxNewTokens);
    }
    if (temperature != null) {
      p.setTemperature(temperature);
    }
    if (topK != null) {
      p.setTopK(topK);
    }
    if (topP != null) {
      p.setTopP(topP);
    }
    if (seed != null) {
      p.setSeed(seed);
    }
    for (int id : eos) {
      p.addEosTokenIds(id);
    }
    p.setIgnoreEos(ignoreEos);
    p.setLogprobs(logprobs);
    if (topLogprobs != null) {
      p.setTopLogprobs(topLogprobs);
    }
    p.addAllStop(stop);
    if (repetitionPenalty != null) {
      p.setRepetitionPenalty(repetitionPenalty);
    }
    if (presencePenalty != null) {
      p.setPresencePenalty(presencePenalty);
    }
    if (frequencyPenalty != null) {
      p.setFrequencyPenalty(frequencyPenalty);
    }
    if (minNewTokens != null) {
      p.setMinNewTokens(minNewTokens);
    }
    p.putAllLogitBias(logitBias);
    return p.build();
  }

  @Override
  public String toString() {
    StringBuilder s = new StringBuilder("SamplingParams{");
    String sep = "";
    if (maxNewTokens != null) {
      s.append(sep).append("maxNewTokens=").append(maxNewTokens);
      sep = ", ";
    }
    if (temperature != null) {
      s.append(sep).append("temperature=").append(temperature);
      sep = ", ";
    }
    if (topK != null) {
      s.append(sep).append("topK=").append(topK);
      sep = ", ";
    }
    if (topP != null) {
      s.append(sep).append("topP=").append(topP);
      sep = ", ";
    }
    if (seed != null) {
      s.append(sep).append("seed=").append(seed);
      sep = ", ";
    }
    if (eos.length > 0) {
      s.append(sep).append("eos=").append(Arrays.toString(eos));
      sep = ", ";
    }
    if (ignoreEos) {
      s.append(sep).append("ignoreEos=true");
      sep = ", ";
    }
    if (logprobs) {
      s.append(sep).append("logprobs=true");
      sep = ", ";
    }
    if (topLogprobs != null) {
      s.append(sep).append("topLogprobs=").append(topLogprobs);
      sep = ", ";
    }
    if (!stop.isEmpty()) {
      s.append(sep).append("stop=").append(stop);
      sep = ", ";
    }
    if (repetitionPenalty != null) {
      s.append(sep).append("repetitionPenalty=").append(repetitionPenalty);
      sep = ", ";
    }
    if (presencePenalty != null) {
      s.append(sep).append("presencePenalty=").append(presencePenalty);
      sep = ", ";
    }
    if (frequencyPenalty != null) {
      s.append(sep).append("frequencyPenalty=").append(frequencyPenalty);
      sep = ", ";
    }
    if (minNewTokens != null) {
      s.append(sep).append("minNewTokens=").append(minNewTokens);
      sep = ", ";
    }
    if (!logitBias.isEmpty()) {
      s.append(sep).append("logitBias=").append(logitBias);
    }
    return s.append('}').toString();
  }

  /** Builds {@link SamplingParams}; every setter is optional. */
  public static final class Builder {
    private Integer maxNewTokens;
    private Float temperature;
    private Integer topK;
    private Float topP;
    private Long seed;
    private int[] eos = new int[0];
    private boolean ignoreEos;
    private boolean logprobs;
    private Integer topLogprobs;
    private List<String> stop = List.of();
    private Float repetitionPenalty;
    private Float presencePenalty;
    private Float frequencyPenalty;
    private Integer minNewTokens;
    private SortedMap<Integer, Float> logitBias = Collections.emptySortedMap();

    private Builder() {}

    /** Maximum number of tokens to generate, EOS included (>= 1). */
    public Builder maxNewTokens(int maxNewTokens) {
      if (maxNewTokens < SamplingBounds.MIN_MAX_NEW_TOKENS) {
        throw new IllegalArgumentException(
            "maxNewTokens must be >= " + SamplingBounds.MIN_MAX_NEW_TOKENS + ", got " + maxNewTokens);
      }
      this.maxNewTokens = maxNewTokens;
      return this;
    }

    /** Softmax temperature; 0 is greedy decoding (argmax). */
    public Builder temperature(double temperature) {
      this.temperature = (float) temperature;
      return this;
    }

    /** Sample among the k most likely tokens only; 0 disables the filter. */
    public Builder topK(int topK) {
      this.topK = nonNegative("topK", topK);
      return this;
    }

    /** Nucleus sampling, in (0, 1]; 1 disables the filter. */
    public Builder topP(double topP) {
      this.topP = (float) topP;
      return this;
    }

    /** Seed of the request's own generator: the same seed gives the same tokens. */
    public Builder seed(long seed) {
      this.seed = seed;
      return this;
    }

    /**
     * Token ids that end generation (emitted, then the request finishes with {@link
     * FinishReason#EOS}), replacing the model's own EOS ids; none: the model's.
     */
    public Builder eos(int... tokenIds) {
      int[] copy = Objects.requireNonNull(tokenIds, "tokenIds").clone();
      for (int i = 0; i < copy.length; i++) {
        Prompt.checkTokenId("eos[" + i + "]", copy[i]);
      }
      this.eos = copy;
      return this;
    }

    /** When true, EOS tokens do not stop generation: it runs to maxNewTokens. */
    public Builder ignoreEos(boolean ignoreEos) {
      this.ignoreEos = ignoreEos;
      return this;
    }

    /** When true, every generated token carries its log-probability. */
    public Builder logprobs(boolean logprobs) {
      this.logprobs = logprobs;
      return this;
    }

    /**
     * Number of most likely alternatives returned per token (implies logprobs when > 0); 0 to
     * {@link SamplingBounds#MAX_TOP_LOGPROBS}.
     */
    public Builder topLogprobs(int topLogprobs) {
      if (topLogprobs < 0 || topLogprobs > SamplingBounds.MAX_TOP_LOGPROBS) {
        throw new IllegalArgumentException(
            "topLogprobs must be in [0, " + SamplingBounds.MAX_TOP_LOGPROBS + "], got " + topLogprobs);
      }
      this.topLogprobs = topLogprobs;
      return this;
    }

    /**
     * Strings that end generation when the decoded output contains one: the request finishes with
     * {@link FinishReason#STOP}, its text cut just before the first match (its token ids still
     * include the token that completed it). A stream holds back text that may begin a stop string
     * until the next tokens tell. At most {@link SamplingBounds#MAX_STOP_STRINGS} strings of 1 to
     * {@link SamplingBounds#MAX_STOP_STRING_CHARS} characters (Unicode code points); needs a model
     * with a tokenizer (checked by the server). Replaces any earlier setting; none: no stop strings.
     */
    public Builder stop(String... stop) {
      return stop(Arrays.asList(Objects.requireNonNull(stop, "stop")));
    }

    /** Stop strings, in order; see {@link #stop(String...)}. */
    public Builder stop(List<String> stop) {
      List<String> copy = new ArrayList<>(Objects.requireNonNull(stop, "stop"));
      if (copy.size() > SamplingBounds.MAX_STOP_STRINGS) {
        throw new IllegalArgumentException(
            "stop: at most " + SamplingBounds.MAX_STOP_STRINGS + " strings, got " + copy.size());
      }
      for (int i = 0; i < copy.size(); i++) {
        String s = Objects.requireNonNull(copy.get(i), "stop[" + i + "]");
        int chars = s.codePointCount(0, s.length());
        if (chars < 1 || chars > SamplingBounds.MAX_STOP_STRING_CHARS) {
          throw new IllegalArgumentException(
              "stop[" + i + "] must be 1 to " + SamplingBounds.MAX_STOP_STRING_CHARS
                  + " characters, got " + chars);
        }
      }
      this.stop = List.copyOf(copy);
      return this;
    }

    /**
     * Divides the positive logits, and multiplies the negative ones, of tokens already in the prompt
     * or the output (transformers' semantics): > 1 discourages repeats. Finite and > 0; 1 disables.
     */
    public Builder repetitionPenalty(double repetitionPenalty) {
      this.repetitionPenalty = (float) repetitionPenalty;
      return this;
    }

    /**
     * Subtracted from the logit of every token generated at least once (OpenAI's semantics; the
     * prompt does not count). In [-2, 2] ({@link
     * SamplingBounds#MAX_ABS_PRESENCE_FREQUENCY_PENALTY}); 0 disables.
     */
    public Builder presencePenalty(double presencePenalty) {
      this.presencePenalty = penalty("presencePenalty", presencePenalty);
      return this;
    }

    /**
     * Subtracted, times the number of times it was generated, from the logit of every generated
     * token (OpenAI's semantics; the prompt does not count). In [-2, 2] ({@link
     * SamplingBounds#MAX_ABS_PRESENCE_FREQUENCY_PENALTY}); 0 disables.
     */
    public Builder frequencyPenalty(double frequencyPenalty) {
      this.frequencyPenalty = penalty("frequencyPenalty", frequencyPenalty);
      return this;
    }

    /**
     * EOS tokens cannot end the request before this many tokens are generated (stop strings still
     * can). At most maxNewTokens (checked by the server).
     */
    public Builder minNewTokens(int minNewTokens) {
      this.minNewTokens = nonNegative("minNewTokens", minNewTokens);
      return this;
    }

    /**
     * Bias added to the logits of these token ids before penalties and temperature, at every step:
     * -100 all but bans a token, 100 all but forces it. At most {@link
     * SamplingBounds#MAX_LOGIT_BIAS_ENTRIES} entries, biases finite in [-100, 100] ({@link
     * SamplingBounds#MAX_ABS_LOGIT_BIAS}); ids must be below the vocabulary size (checked by the
     * server). Replaces any earlier setting.
     */
    public Builder logitBias(Map<Integer, Double> logitBias) {
      TreeMap<Integer, Float> copy = new TreeMap<>();
      Objects.requireNonNull(logitBias, "logitBias");
      if (logitBias.size() > SamplingBounds.MAX_LOGIT_BIAS_ENTRIES) {
        throw new IllegalArgumentException(
            "logitBias: at most " + SamplingBounds.MAX_LOGIT_BIAS_ENTRIES + " entries, got "
                + logitBias.size());
      }
      for (Map.Entry<Integer, Double> e : logitBias.entrySet()) {
        Integer id = Objects.requireNonNull(e.getKey(), "logitBias token id");
        Prompt.checkTokenId("logitBias token id", id);
        double bias = Objects.requireNonNull(e.getValue(), "logitBias[" + id + "]");
        copy.put(id, bounded("logitBias[" + id + "]", bias, SamplingBounds.MAX_ABS_LOGIT_BIAS));
      }
      this.logitBias = Collections.unmodifiableSortedMap(copy);
      return this;
    }

    /**
     * The parameters.
     *
     * @throws IllegalArgumentException when minNewTokens is above maxNewTokens (both set)
     */
    public SamplingParams build() {
      if (minNewTokens != null && maxNewTokens != null && minNewTokens > maxNewTokens) {
        throw new IllegalArgumentException(
            "minNewTokens (" + minNewTokens + ") must be at most maxNewTokens (" + maxNewTokens
                + ")");
      }
      return new SamplingParams(this);
    }

    private static float penalty(String name, double value) {
      return bounded(name, value, SamplingBounds.MAX_ABS_PRESENCE_FREQUENCY_PENALTY);
    }

    private static float bounded(String name, double value, double maxAbs) {
      if (!(Math.abs(value) <= maxAbs)) { // NaN fails too
        throw new IllegalArgumentException(
            name + " must be finite, in [" + -maxAbs + ", " + maxAbs + "], got " + value);
      }
      return (float) value;
    }

    private static int nonNegative(String name, int value) {
      if (value < 0) {
        throw new IllegalArgumentException(name + " must be >= 0, got " + value);
      }
      return value;
    }
  }
}
