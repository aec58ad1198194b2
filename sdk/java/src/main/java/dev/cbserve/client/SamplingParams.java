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
 * table every SDK shares) with an {@link IllegalArgumentException} whose message is the server's
 * own for that value, naming the wire field, the bound and the value ({@code
 * sampling.temperature must be a finite number >= 0, got -1.0}); bounds that depend on the model
 * (token ids below the vocabulary size, a tokenizer for stop strings) are checked by the server
 * ({@link InvalidArgumentException}).
 *
 * <pre>{@code
 * SamplingParams greedy = SamplingParams.builder().maxNewTokens(32).temperature(0).build();
 * SamplingParams json = SamplingParams.builder().maxNewTokens(64)
 *     .jsonSchema("{\"type\": \"object\"}").build();
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
  private final Float minP;
  private final int[] stopTokenIds;
  private final Boolean skipSpecialTokens;
  private final Integer promptLogprobs;
  private final LogprobsMode logprobsMode;
  private final boolean returnKeptMass;
  private final Integer n;
  private final Constraint constraint;
  private final String constraintSpec;

  /** The kinds of {@code structured_output}, named as the builder's setters and the wire. */
  private enum Constraint {
    JSON_SCHEMA("jsonSchema", "json_schema"),
    JSON_OBJECT("jsonObject", "json_object"),
    REGEX("regex", "regex"),
    GRAMMAR("grammar", "grammar");

    final String setter;
    final String field;

    Constraint(String setter, String field) {
      this.setter = setter;
      this.field = field;
    }
  }

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
    this.minP = b.minP;
    this.stopTokenIds = b.stopTokenIds.clone();
    this.skipSpecialTokens = b.skipSpecialTokens;
    this.promptLogprobs = b.promptLogprobs;
    this.logprobsMode = b.logprobsMode;
    this.returnKeptMass = b.returnKeptMass;
    this.n = b.n;
    this.constraint = b.constraint;
    this.constraintSpec = b.constraintSpec;
  }

  /** All fields unset: the server's defaults. */
  public static SamplingParams defaults() {
    return DEFAULTS;
  }

  /** A new builder with every field unset. */
  public static Builder builder() {
    return new Builder();
  }

  /** The number of sequences set with {@link Builder#n(int)}, or null when unset (the server's 1). */
  Integer n() {
    return n;
  }

  /** Whether these parameters ask for logprobs (logprobs, top logprobs above 0, or the kept mass). */
  boolean wantsLogprobs() {
    return logprobs || (topLogprobs != null && topLogprobs > 0) || returnKeptMass;
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
    if (minP != null) {
      p.setMinP(minP);
    }
    for (int id : stopTokenIds) {
      p.addStopTokenIds(id);
    }
    if (skipSpecialTokens != null) {
      p.setSkipSpecialTokens(skipSpecialTokens);
    }
    if (promptLogprobs != null) {
      p.setPromptLogprobs(promptLogprobs);
    }
    if (n != null) {
      p.setN(n);
    }
    p.setLogprobsMode(logprobsMode.wire);
    p.setReturnKeptMass(returnKeptMass);
    if (constraint != null) {
      Types.StructuredOutput.Builder so = Types.StructuredOutput.newBuilder();
      switch (constraint) {
        case JSON_SCHEMA:
          so.setJsonSchema(constraintSpec);
          break;
        case JSON_OBJECT:
          so.setJsonObject(true);
          break;
        case REGEX:
          so.setRegex(constraintSpec);
          break;
        default:
          so.setGrammar(constraintSpec);
          break;
      }
      p.setStructuredOutput(so);
    }
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
      sep = ", ";
    }
    if (minP != null) {
      s.append(sep).append("minP=").append(minP);
      sep = ", ";
    }
    if (stopTokenIds.length > 0) {
      s.append(sep).append("stopTokenIds=").append(Arrays.toString(stopTokenIds));
      sep = ", ";
    }
    if (skipSpecialTokens != null) {
      s.append(sep).append("skipSpecialTokens=").append(skipSpecialTokens);
      sep = ", ";
    }
    if (promptLogprobs != null) {
      s.append(sep).append("promptLogprobs=").append(promptLogprobs);
      sep = ", ";
    }
    if (n != null) {
      s.append(sep).append("n=").append(n);
      sep = ", ";
    }
    if (logprobsMode != LogprobsMode.SERVER_DEFAULT) {
      s.append(sep).append("logprobsMode=").append(logprobsMode);
      sep = ", ";
    }
    if (returnKeptMass) {
      s.append(sep).append("returnKeptMass=true");
      sep = ", ";
    }
    if (constraint == Constraint.JSON_OBJECT) {
      s.append(sep).append("jsonObject");
    } else if (constraint != null) {
      s.append(sep).append(constraint.setter).append('=').append(abbreviated(constraintSpec));
    }
    return s.append('}').toString();
  }

  /** A spec for toString: whole up to 64 code points, else its first 61 and "...". */
  private static String abbreviated(String spec) {
    if (spec.codePointCount(0, spec.length()) <= 64) {
      return spec;
    }
    return spec.substring(0, spec.offsetByCodePoints(0, 61)) + "...";
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
    private Float minP;
    private int[] stopTokenIds = new int[0];
    private Boolean skipSpecialTokens;
    private Integer promptLogprobs;
    private LogprobsMode logprobsMode = LogprobsMode.SERVER_DEFAULT;
    private boolean returnKeptMass;
    private Integer n;
    private Constraint constraint;
    private String constraintSpec;

    private Builder() {}

    /** Maximum number of tokens to generate, EOS included (>= 1). */
    public Builder maxNewTokens(int maxNewTokens) {
      this.maxNewTokens =
          ServerWording.checkInt(
              "sampling.max_new_tokens", maxNewTokens, SamplingBounds.MIN_MAX_NEW_TOKENS);
      return this;
    }

    /** Softmax temperature, finite and >= 0; 0 is greedy decoding (argmax). */
    public Builder temperature(double temperature) {
      this.temperature =
          ServerWording.checkNumber("sampling.temperature", temperature, ">= 0", t -> t >= 0);
      return this;
    }

    /** Sample among the k most likely tokens only; 0 disables the filter. */
    public Builder topK(int topK) {
      this.topK = ServerWording.checkInt("sampling.top_k", topK, 0, null, " (0 disables it)");
      return this;
    }

    /** Nucleus sampling, in (0, 1]; 1 disables the filter. */
    public Builder topP(double topP) {
      this.topP =
          ServerWording.checkNumber("sampling.top_p", topP, "in (0, 1]", p -> p > 0 && p <= 1);
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
        ServerWording.checkInt("sampling.eos_token_ids[" + i + "]", copy[i], 0);
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
      this.topLogprobs =
          ServerWording.checkInt(
              "sampling.top_logprobs", topLogprobs, 0, (long) SamplingBounds.MAX_TOP_LOGPROBS, "");
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
            "sampling.stop: at most " + SamplingBounds.MAX_STOP_STRINGS + " strings, got "
                + copy.size());
      }
      for (int i = 0; i < copy.size(); i++) {
        String s = Objects.requireNonNull(copy.get(i), "stop[" + i + "]");
        int chars = s.codePointCount(0, s.length());
        if (chars < 1 || chars > SamplingBounds.MAX_STOP_STRING_CHARS) {
          throw new IllegalArgumentException(
              "sampling.stop[" + i + "] must be 1 to " + SamplingBounds.MAX_STOP_STRING_CHARS
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
      this.repetitionPenalty =
          ServerWording.checkNumber(
              "sampling.repetition_penalty", repetitionPenalty, "> 0 (1 disables it)", p -> p > 0);
      return this;
    }

    /**
     * Subtracted from the logit of every token generated at least once (OpenAI's semantics; the
     * prompt does not count). In [-2, 2] ({@link
     * SamplingBounds#MAX_ABS_PRESENCE_FREQUENCY_PENALTY}); 0 disables.
     */
    public Builder presencePenalty(double presencePenalty) {
      this.presencePenalty = penalty("sampling.presence_penalty", presencePenalty);
      return this;
    }

    /**
     * Subtracted, times the number of times it was generated, from the logit of every generated
     * token (OpenAI's semantics; the prompt does not count). In [-2, 2] ({@link
     * SamplingBounds#MAX_ABS_PRESENCE_FREQUENCY_PENALTY}); 0 disables.
     */
    public Builder frequencyPenalty(double frequencyPenalty) {
      this.frequencyPenalty = penalty("sampling.frequency_penalty", frequencyPenalty);
      return this;
    }

    /**
     * EOS tokens cannot end the request before this many tokens are generated (stop strings still
     * can). At most maxNewTokens (checked by the server).
     */
    public Builder minNewTokens(int minNewTokens) {
      this.minNewTokens = ServerWording.checkInt("sampling.min_new_tokens", minNewTokens, 0);
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
            "sampling.logit_bias: at most " + SamplingBounds.MAX_LOGIT_BIAS_ENTRIES
                + " entries, got " + logitBias.size());
      }
      for (Map.Entry<Integer, Double> e : new TreeMap<>(logitBias).entrySet()) {
        Integer id = Objects.requireNonNull(e.getKey(), "logitBias token id");
        ServerWording.checkInt("sampling.logit_bias key", id, 0);
        double bias = Objects.requireNonNull(e.getValue(), "logitBias[" + id + "]");
        copy.put(
            id,
            bounded("sampling.logit_bias[" + id + "]", bias, SamplingBounds.MAX_ABS_LOGIT_BIAS));
      }
      this.logitBias = Collections.unmodifiableSortedMap(copy);
      return this;
    }

    /**
     * Samples only among the tokens whose probability is at least {@code minP} times the most
     * likely token's (after temperature, top-k and top-p). In [0, 1] ({@link
     * SamplingBounds#MAX_MIN_P}); 0 disables it. Unset: the model's generation config when it
     * samples, else 0.
     */
    public Builder minP(double minP) {
      this.minP =
          ServerWording.checkNumber(
              "sampling.min_p",
              minP,
              "in [0, " + ServerWording.bound(SamplingBounds.MAX_MIN_P) + "] (0 disables it)",
              p -> p >= 0 && p <= SamplingBounds.MAX_MIN_P);
      return this;
    }

    /**
     * Token ids that end generation besides the EOS ids, even with {@code ignoreEos}: the id is
     * emitted, then the request finishes with {@link FinishReason#STOP} and {@link
     * Completion#stopTokenId()} (or {@link Chunk#stopTokenId()}) says which. {@code minNewTokens}
     * holds them back as it does EOS. At most {@link SamplingBounds#MAX_STOP_TOKEN_IDS} ids, below
     * the vocabulary size (checked by the server). Replaces any earlier setting; none: no stop
     * token ids.
     */
    public Builder stopTokenIds(int... tokenIds) {
      int[] copy = Objects.requireNonNull(tokenIds, "tokenIds").clone();
      if (copy.length > SamplingBounds.MAX_STOP_TOKEN_IDS) {
        throw new IllegalArgumentException(
            "sampling.stop_token_ids: at most " + SamplingBounds.MAX_STOP_TOKEN_IDS
                + " token ids, got " + copy.length);
      }
      for (int i = 0; i < copy.length; i++) {
        ServerWording.checkInt("sampling.stop_token_ids[" + i + "]", copy[i], 0);
      }
      this.stopTokenIds = copy;
      return this;
    }

    /** Stop token ids; see {@link #stopTokenIds(int...)}. */
    public Builder stopTokenIds(List<Integer> tokenIds) {
      Objects.requireNonNull(tokenIds, "tokenIds");
      int[] ids = new int[tokenIds.size()];
      for (int i = 0; i < ids.length; i++) {
        ids[i] = Objects.requireNonNull(tokenIds.get(i), "stopTokenIds[" + i + "]");
      }
      return stopTokenIds(ids);
    }

    /**
     * Whether the text leaves out special tokens (BOS, EOS, chat-template markers); the token ids
     * always include them. Unset: true.
     */
    public Builder skipSpecialTokens(boolean skipSpecialTokens) {
      this.skipSpecialTokens = skipSpecialTokens;
      return this;
    }

    /**
     * Returns, for every prompt token after the first, its log-probability given the tokens before
     * it and this many most likely alternatives at its position ({@link
     * Completion#promptLogprobs()}; when streaming, on the chunk of the first generated token); 0
     * returns the prompt tokens' own only. 0 to {@link SamplingBounds#MAX_PROMPT_LOGPROBS}. Such a
     * request does not read the prefix cache for its prompt (every prompt position is computed).
     */
    public Builder promptLogprobs(int promptLogprobs) {
      this.promptLogprobs =
          ServerWording.checkInt(
              "sampling.prompt_logprobs",
              promptLogprobs,
              0,
              (long) SamplingBounds.MAX_PROMPT_LOGPROBS,
              " (0: the prompt token's only)");
      return this;
    }

    /**
     * Which distribution the {@link #logprobs(boolean) logprobs} and {@link #topLogprobs(int) top
     * logprobs} are of (vLLM's {@code logprobs_mode}); prompt logprobs are always raw. Unset:
     * {@link LogprobsMode#SERVER_DEFAULT}.
     */
    public Builder logprobsMode(LogprobsMode logprobsMode) {
      this.logprobsMode = Objects.requireNonNull(logprobsMode, "logprobsMode");
      return this;
    }

    /**
     * When true, every generated token's {@link TokenLogprob} also carries {@link
     * TokenLogprob#logKeptMass() the log of the probability mass} top-k, top-p and min-p kept of
     * the distribution they truncated; implies logprobs. The server refuses it for a greedy request
     * (temperature 0, or unset without a sampling default): its token is drawn from no
     * distribution.
     */
    public Builder returnKeptMass(boolean returnKeptMass) {
      this.returnKeptMass = returnKeptMass;
      return this;
    }

    /**
     * Parallel sampling: the number of completions to sample from the prompt (OpenAI's and vLLM's
     * {@code n}). The server computes the prompt once and shares its KV cache; each sequence then
     * samples, stops and streams on its own ({@link Chunk#index()} says whose a chunk is). With a
     * {@link #seed(long) seed} s, sequence i samples with seed s + i (mod 2<sup>64</sup>), so it
     * equals a request of n = 1 seeded with s + i. 1 to {@link SamplingBounds#MAX_N}. Unset: 1.
     *
     * <p>Read all n with {@link CbserveClient#generateN(Prompt, int, SamplingParams)} or {@link
     * CbserveClient#stream(Prompt, SamplingParams)} (the chunks of the sequences interleaved); {@link
     * CbserveClient#generate(Prompt, SamplingParams)} returns one completion and refuses n &gt; 1.
     *
     * @throws IllegalArgumentException when {@code n} is outside [1, {@link SamplingBounds#MAX_N}]
     */
    public Builder n(int n) {
      this.n = checkN(n);
      return this;
    }

    /**
     * Constrains the output to instances of this JSON schema (a JSON document, e.g. {@code
     * {"type": "object", "required": ["name"]}}): every token is sampled among those that keep the
     * output a valid prefix, and the request ends once the value is complete. The server compiles
     * it ({@link InvalidArgumentException} quoting the compiler when it does not). 1 to {@link
     * SamplingBounds#MAX_STRUCTURED_OUTPUT_CHARS} characters. At most one of {@code jsonSchema},
     * {@link #jsonObject()}, {@link #regex(String)} and {@link #grammar(String)}; the same one
     * again replaces it.
     *
     * @throws IllegalArgumentException when another of the four is set, or the schema is empty or
     *     too long
     */
    public Builder jsonSchema(String schema) {
      return constrain(Constraint.JSON_SCHEMA, schema);
    }

    /**
     * Constrains the output to any JSON object; see {@link #jsonSchema(String)}.
     *
     * @throws IllegalArgumentException when {@code jsonSchema}, {@code regex} or {@code grammar} is
     *     set
     */
    public Builder jsonObject() {
      return constrain(Constraint.JSON_OBJECT, "");
    }

    /**
     * Constrains the whole output to match this regular expression; see {@link
     * #jsonSchema(String)}.
     *
     * @throws IllegalArgumentException when another constraint is set, or the expression is empty
     *     or too long
     */
    public Builder regex(String regex) {
      return constrain(Constraint.REGEX, regex);
    }

    /**
     * Constrains the output to derive from this EBNF grammar (Lark / GBNF style, start rule {@code
     * start} or {@code root}); see {@link #jsonSchema(String)}.
     *
     * @throws IllegalArgumentException when another constraint is set, or the grammar is empty or
     *     too long
     */
    public Builder grammar(String grammar) {
      return constrain(Constraint.GRAMMAR, grammar);
    }

    private Builder constrain(Constraint kind, String spec) {
      Objects.requireNonNull(spec, kind.setter);
      if (constraint != null && constraint != kind) {
        throw new IllegalArgumentException(
            kind.setter + ": " + constraint.setter + " is already set (set at most one of"
                + " jsonSchema, jsonObject, regex and grammar)");
      }
      if (kind != Constraint.JSON_OBJECT) {
        String field = "sampling.structured_output." + kind.field;
        int chars = spec.codePointCount(0, spec.length());
        if (chars < 1) {
          throw new IllegalArgumentException(field + " must not be empty");
        }
        if (chars > SamplingBounds.MAX_STRUCTURED_OUTPUT_CHARS) {
          throw new IllegalArgumentException(
              field + " must be at most " + SamplingBounds.MAX_STRUCTURED_OUTPUT_CHARS
                  + " characters, got " + chars);
        }
      }
      this.constraint = kind;
      this.constraintSpec = spec;
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
            "sampling.min_new_tokens (" + minNewTokens + ") must not exceed max_new_tokens ("
                + maxNewTokens + ")");
      }
      return new SamplingParams(this);
    }

    /** {@code n} when it is a valid number of sequences, else an IllegalArgumentException. */
    static int checkN(int n) {
      return ServerWording.checkInt("sampling.n", n, 1, (long) SamplingBounds.MAX_N, "");
    }

    private static float penalty(String field, double value) {
      return bounded(field, value, SamplingBounds.MAX_ABS_PRESENCE_FREQUENCY_PENALTY);
    }

    private static float bounded(String field, double value, double maxAbs) {
      String bound = ServerWording.bound(maxAbs);
      return ServerWording.checkNumber(
          field, value, "in [-" + bound + ", " + bound + "]", v -> Math.abs(v) <= maxAbs);
    }
  }
}
