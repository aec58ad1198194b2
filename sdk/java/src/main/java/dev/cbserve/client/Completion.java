package dev.cbserve.client;

import java.time.Instant;
import java.util.List;
import java.util.Optional;

/**
 * The whole output of one request ({@link CbserveClient#generate}), or of one of its sequences
 * ({@link CbserveClient#generateN}, with {@link SamplingParams.Builder#n(int) n} &gt; 1: then its
 * tokens, text, logprobs, finish reason, timings and generated-token count are that sequence's own,
 * and {@code requestId} the request's, shared by the n).
 *
 * @param requestId the request's id
 * @param tokenIds every generated token id
 * @param text the decoded output; empty when the server has no tokenizer ({@link
 *     ModelInfo#hasTokenizer()}); never null
 * @param finishReason why it ended ({@link FinishReason#ERROR}: see {@code error})
 * @param usage token counts, or null if the server sent none
 * @param logprobs one entry per token when logprobs were asked for; empty otherwise
 * @param weightVersion version of the weights that produced the last token (0 if none)
 * @param weightVersions every weights version seen, in order (several when the weights were updated
 *     while the request ran)
 * @param error why the request failed, or null
 * @param timings the request's timings, or null
 * @param tokenTimestamps with {@code recordTimestamps}, each token's server time; empty otherwise
 * @param stopTokenId with {@link FinishReason#STOP} from one of {@link
 *     SamplingParams.Builder#stopTokenIds(int...)}: that id (the last of {@code tokenIds}); empty
 *     otherwise
 * @param stopString with {@link FinishReason#STOP} from one of {@link
 *     SamplingParams.Builder#stop(String...)}: the stop string the text matched (the text ends just
 *     before it); empty otherwise
 * @param promptLogprobs with {@link SamplingParams.Builder#promptLogprobs(int)}: one entry per
 *     prompt token after the first (the first has nothing before it); empty otherwise
 * @param index which of the request's sequences this is, 0 to n - 1 ({@link
 *     SamplingParams.Builder#n(int)}); 0 when n = 1
 */
public record Completion(
    String requestId,
    TokenIds tokenIds,
    String text,
    FinishReason finishReason,
    Usage usage,
    List<TokenLogprob> logprobs,
    long weightVersion,
    List<Long> weightVersions,
    String error,
    Timings timings,
    List<Instant> tokenTimestamps,
    Optional<Integer> stopTokenId,
    Optional<String> stopString,
    List<PromptLogprob> promptLogprobs,
    int index) {

  /** Copies the lists into immutable ones; a null text becomes empty, a null optional empty. */
  public Completion {
    text = text == null ? "" : text;
    logprobs = List.copyOf(logprobs);
    weightVersions = List.copyOf(weightVersions);
    tokenTimestamps = List.copyOf(tokenTimestamps);
    stopTokenId = stopTokenId == null ? Optional.empty() : stopTokenId;
    stopString = stopString == null ? Optional.empty() : stopString;
    promptLogprobs = List.copyOf(promptLogprobs);
  }
}
