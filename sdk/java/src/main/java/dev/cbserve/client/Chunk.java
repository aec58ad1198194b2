package dev.cbserve.client;

import io.grpc.Status;
import java.time.Instant;
import java.util.List;
import java.util.Optional;

/**
 * A piece of one request's output (a delta). A request's chunks, in order, make its whole output:
 * their token ids concatenate ({@code tokenIndex} is the index of {@code tokenIds.getInt(0)} among the
 * request's generated tokens), and so do their texts. A chunk may carry no token at all (a status
 * change, the final usage).
 *
 * <p>With {@link SamplingParams.Builder#n(int) n} &gt; 1 a request has n sequences, and each chunk
 * belongs to one of them ({@code index}): its token index, tokens, text, logprobs, status, finish
 * reason and generated-token count are that sequence's, and the sequences' chunks come interleaved.
 * Each sequence ends with its own terminal chunk; the request is over once all n have.
 *
 * @param requestId the request this chunk belongs to
 * @param tokenIndex index, among the request's generated tokens, of the first token of this chunk
 * @param tokenIds the new token ids
 * @param text the new text (never a split UTF-8 character); empty when there is none, or when the
 *     server has no tokenizer ({@link ModelInfo#hasTokenizer()}); never null
 * @param status the request's status after this chunk
 * @param finishReason why the request ended; null until a terminal chunk
 * @param error why the request failed (status FAILED); null otherwise
 * @param errorCode with status FAILED, the gRPC status code that best describes the failure
 *     ({@link CbserveException#of(Status.Code, String)} builds the matching exception); {@code OK}
 *     otherwise
 * @param logprobs one entry per token when logprobs were asked for; empty otherwise
 * @param usage token counts so far (always set on the final chunk), or null
 * @param timings the request's timings so far (always set on the final chunk), or null
 * @param weightVersion version of the weights that produced these tokens
 * @param tokenTimestamps with {@code recordTimestamps}, each token's server wall-clock time (as
 *     {@link Timings}); empty otherwise
 * @param stopTokenId with {@link FinishReason#STOP} from one of {@link
 *     SamplingParams.Builder#stopTokenIds(int...)}: that id (the last of {@code tokenIds}); empty
 *     otherwise
 * @param stopString with {@link FinishReason#STOP} from one of {@link
 *     SamplingParams.Builder#stop(String...)}: the stop string the text matched; empty otherwise
 * @param promptLogprobs with {@link SamplingParams.Builder#promptLogprobs(int)}, on the chunk of
 *     the first generated token ({@code tokenIndex} 0): one entry per prompt token after the
 *     first; empty otherwise
 * @param index the sequence this chunk belongs to, 0 to n - 1 ({@link
 *     SamplingParams.Builder#n(int)}); 0 when n = 1
 */
public record Chunk(
    String requestId,
    int tokenIndex,
    TokenIds tokenIds,
    String text,
    RequestStatus status,
    FinishReason finishReason,
    String error,
    Status.Code errorCode,
    List<TokenLogprob> logprobs,
    Usage usage,
    Timings timings,
    long weightVersion,
    List<Instant> tokenTimestamps,
    Optional<Integer> stopTokenId,
    Optional<String> stopString,
    List<PromptLogprob> promptLogprobs,
    int index) {

  /** Copies the lists into immutable ones; a null text becomes empty, a null optional empty. */
  public Chunk {
    text = text == null ? "" : text;
    logprobs = List.copyOf(logprobs);
    tokenTimestamps = List.copyOf(tokenTimestamps);
    stopTokenId = stopTokenId == null ? Optional.empty() : stopTokenId;
    stopString = stopString == null ? Optional.empty() : stopString;
    promptLogprobs = List.copyOf(promptLogprobs);
  }

  /**
   * True when this chunk ends its request (FINISHED, CANCELLED or FAILED); with n &gt; 1, when it
   * ends its sequence ({@link #index()}).
   */
  public boolean isFinished() {
    return status.isTerminal();
  }
}
