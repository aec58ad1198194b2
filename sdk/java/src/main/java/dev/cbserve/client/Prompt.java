package dev.cbserve.client;

import cbserve.v1.Types;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;
import java.util.Objects;

/**
 * A prompt: plain text (tokenized by the server), token ids (passed to the model as they are), or
 * chat messages (rendered with the model's chat template). Immutable.
 *
 * <p>The server validates prompts: an empty one, or a token id outside the vocabulary, fails with
 * {@link InvalidArgumentException}.
 */
public final class Prompt {
  private enum Kind {
    TEXT,
    TOKENS,
    CHAT
  }

  private final Kind kind;
  private final String text;
  private final int[] tokens;
  private final List<Message> messages;
  private final Boolean addGenerationPrompt;

  private Prompt(
      Kind kind, String text, int[] tokens, List<Message> messages, Boolean addGenerationPrompt) {
    this.kind = kind;
    this.text = text;
    this.tokens = tokens;
    this.messages = messages;
    this.addGenerationPrompt = addGenerationPrompt;
  }

  /** Plain text, tokenized by the server (needs a model with a tokenizer). */
  public static Prompt text(String text) {
    return new Prompt(Kind.TEXT, Objects.requireNonNull(text, "text"), null, null, null);
  }

  /** Token ids, passed to the model unchanged (no BOS or special tokens are added). */
  public static Prompt tokens(int... ids) {
    int[] copy = Objects.requireNonNull(ids, "ids").clone();
    for (int i = 0; i < copy.length; i++) {
      ServerWording.checkInt("token_ids.ids[" + i + "]", copy[i], 0);
    }
    return new Prompt(Kind.TOKENS, null, copy, null, null);
  }

  /** Token ids, passed to the model unchanged (no BOS or special tokens are added). */
  public static Prompt tokens(List<Integer> ids) {
    Objects.requireNonNull(ids, "ids");
    int[] array = new int[ids.size()];
    for (int i = 0; i < array.length; i++) {
      array[i] = Objects.requireNonNull(ids.get(i), "ids[" + i + "]");
    }
    return tokens(array);
  }

  /** A chat conversation, oldest message first; the model answers the last message. */
  public static Prompt chat(Message... messages) {
    return chat(Arrays.asList(Objects.requireNonNull(messages, "messages")));
  }

  /** A chat conversation, oldest message first; the model answers the last message. */
  public static Prompt chat(List<Message> messages) {
    return chat(messages, null);
  }

  /**
   * A chat conversation. {@code addGenerationPrompt = false} continues the last (assistant)
   * message instead of opening a new assistant turn; null leaves it to the server (true).
   */
  public static Prompt chat(List<Message> messages, Boolean addGenerationPrompt) {
    List<Message> copy = new ArrayList<>(Objects.requireNonNull(messages, "messages"));
    for (int i = 0; i < copy.size(); i++) {
      Objects.requireNonNull(copy.get(i), "messages[" + i + "]");
    }
    return new Prompt(Kind.CHAT, null, null, List.copyOf(copy), addGenerationPrompt);
  }

  /** Sets this prompt on a GenerationRequest builder. */
  void applyTo(Types.GenerationRequest.Builder request) {
    switch (kind) {
      case TEXT:
        request.setText(text);
        break;
      case TOKENS:
        Types.TokenIds.Builder ids = Types.TokenIds.newBuilder();
        for (int id : tokens) {
          ids.addIds(id);
        }
        request.setTokenIds(ids);
        break;
      case CHAT:
        Types.ChatMessages.Builder chat = Types.ChatMessages.newBuilder();
        for (Message message : messages) {
          chat.addMessages(
              Types.ChatMessage.newBuilder()
                  .setRole(message.role())
                  .setContent(message.content()));
        }
        if (addGenerationPrompt != null) {
          chat.setAddGenerationPrompt(addGenerationPrompt);
        }
        request.setMessages(chat);
        break;
      default:
        throw new AssertionError(kind);
    }
  }

  @Override
  public String toString() {
    switch (kind) {
      case TEXT:
        return "Prompt.text(" + text.length() + " chars)";
      case TOKENS:
        return "Prompt.tokens(" + tokens.length + " ids)";
      default:
        return "Prompt.chat(" + messages.size() + " messages)";
    }
  }
}
